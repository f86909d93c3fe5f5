"""The epoch's training metrics so far, kept in the checkpoint: a run resumed mid-epoch
reports the whole epoch, on any number of replicas and workers.

Keras keeps a metric's state in variables synchronized on read: each replica holds its own
share, and reading the whole sums the shares over every replica, across workers in a
collective of its own. The sums are kept in one plain variable of this process, which a
save reads alone. In one process they are read at each save (Manager, record()); across
workers a read at the save would be a collective of its own, and a worker saving on SIGTERM
would meet a peer still in its step with it (the peer took it for the step's and crashed):
there the whole is taken where the workers already meet, the engine's one all-reduce at the
end of every training call, which carries each replica's share (shares()). A restore puts
the sums back (place()): the whole on the first replica of the first worker, nothing on
every other, so the sum over the replicas is the saved one on any replica or worker count.
"""
import numpy as np
import tensorflow as tf

CHECKPOINT_KEY = "epoch_metrics"  # the checkpoint's name of the sums


class EpochMetrics:
    """The sums of the metric variables `variables_fn()` returns (a list that may grow
    once: a model's own metrics are built at its first step), as of the last save (one
    process) or the last training call's end (several workers)."""

    def __init__(self, variables_fn):
        self.variables = variables_fn
        # made outside any strategy's scope: one copy in this process, saved without a
        # collective (its length is set by the first record, or by a restore)
        self.sums = tf.Variable(tf.zeros([0], tf.float64), shape=tf.TensorShape([None]),
                                trainable=False, name="epoch_metric_sums")
        self._to_place = False  # restored sums not yet given to the metrics

    def shares(self, replica, replicas):
        """This replica's share of each metric variable's whole, in float32 (in a replica
        function; `replica` its id in the sync group): summed over every replica, the value
        Keras reads across the replicas."""
        parts = []
        for v in self.variables():
            value = tf.reshape(tf.cast(v.value, tf.float32), [-1])
            if v.aggregation == "mean":
                value /= replicas
            elif v.aggregation != "sum":  # the first replica's copy is the whole
                value = tf.where(tf.equal(replica, 0), value, tf.zeros_like(value))
            parts.append(value)
        return parts

    def local_values(self):
        """Each metric variable's whole, read across this process's replicas (one process
        only: across workers the read is a collective)."""
        return [tf.reshape(tf.cast(v.value, tf.float32), [-1]) for v in self.variables()]

    def record(self, sums):
        """Keeps `sums` (shares() summed over the replicas, in the training call's function;
        or local_values() at a save) for the save."""
        if sums:
            self.sums.assign(tf.cast(tf.concat(sums, 0), tf.float64))

    def clear(self):
        """A new epoch: nothing counted yet."""
        self.sums.assign(tf.zeros_like(self.sums))

    def restored(self, strategy, first_worker):
        """After a restore: the sums go to the metrics now, or once they are built."""
        self._to_place = True
        self.place(strategy, first_worker)

    def place(self, strategy, first_worker):
        """Gives restored sums to the metric variables: a summed variable's whole to the
        first replica of the first worker (first_worker: this process is), zeros to every
        other copy; any other variable's to every copy. Nothing while the metrics are not
        built (their sizes do not add up to the sums'); nothing saved (a checkpoint of an
        earlier tfmulti): the epoch's figures count from the resume."""
        if not self._to_place:
            return
        saved = self.sums.numpy()
        variables = self.variables()
        sizes = [int(np.prod(v.shape)) for v in variables]
        if not saved.size or saved.size != sum(sizes):
            return
        for v, part in zip(variables, np.split(saved, np.cumsum(sizes)[:-1])):
            whole = part.reshape(v.shape).astype(v.dtype)
            for i, copy in enumerate(strategy.experimental_local_results(v.value)):
                given = v.aggregation != "sum" or (first_worker and i == 0)
                copy.assign(whole if given else np.zeros_like(whole))
        self._to_place = False


class Manager(tf.train.CheckpointManager):
    """A CheckpointManager that runs before_save() (when given) before each save: the sums
    taken then."""

    def __init__(self, checkpoint, directory, max_to_keep, before_save=None):
        super().__init__(checkpoint, directory, max_to_keep=max_to_keep)
        self._before_save = before_save

    def save(self, *args, **kwargs):
        if self._before_save is not None:
            self._before_save()
        return super().save(*args, **kwargs)
