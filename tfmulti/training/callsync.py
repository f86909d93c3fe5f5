"""What the replicas agree on once per training call, in ONE all-reduce: the batch-norm
moving statistics (averaged), and with several workers the training metrics' state (summed
over the replicas: what a checkpoint keeps of them, epoch_metrics.py), each worker's per-step
losses, its stop vote and its seconds computing and all-reducing.

Keras 3 batch norm keeps each replica's own moving mean and variance (its variables have no
aggregation), so replicas would drift apart and evaluate differently. The moving averages
are linear in the batch statistics, so averaging them across replicas after k steps equals
averaging each step's update: the tf.keras (MEAN aggregation) result. Losses and votes ride
along: one collective per call instead of one per step for the loss (a collective's latency
is paid in full, whatever its size).
"""
import tensorflow as tf


def replica_end_of_call(strategy, model, epoch_metrics, worker_losses, stop_vote, spent):
    """In a replica context, with several replicas: (the workers' per-step losses, their stop
    votes, their seconds [2, workers] by kind (timing.py), the metrics' sums across workers
    (else [])) of this worker's worker_losses, stop_vote and spent ([2]: computing,
    all-reducing); the batch-norm statistics averaged in place. `strategy`, `model` and
    `epoch_metrics` (epoch_metrics.EpochMetrics) the engine's."""
    context = tf.distribute.get_replica_context()
    stats = [v for v in model.non_trainable_variables if v.dtype.startswith("float")]
    values = []
    for v in stats:  # placed values: the multi-worker all-reduce needs a device
        with tf.device(v.value.device):
            values.append(tf.cast(tf.identity(v.value), tf.float32))
    n = strategy.num_replicas_in_sync
    local = len(strategy.extended.worker_devices)
    workers, multi_worker = n // local, n > local
    replica = context.replica_id_in_sync_group
    # across workers, the metrics' sums for the next save (read at the save itself, a
    # collective of its own, they once crashed a peer on SIGTERM)
    shares = epoch_metrics.shares(replica, n) if multi_worker else []
    values += shares
    if multi_worker:  # each worker's share, given once (by its first replica)
        first = tf.equal(replica % local, 0)
        column = tf.one_hot(replica // local, workers, dtype=tf.float32)
        mine = tf.concat([worker_losses, tf.reshape(tf.cast(stop_vote, tf.float32), [1]),
                          tf.reshape(column[None, :] * tf.cast(spent, tf.float32)[:, None],
                                     [-1])], 0)
        values.append(tf.where(first, mine, tf.zeros_like(mine)))
    if not values:  # one worker, no batch norm, no metrics
        return worker_losses, stop_vote, spent[:, None], []
    sums = context.all_reduce(tf.distribute.ReduceOp.SUM, values)
    for variable, total in zip(stats, sums):
        variable.assign(tf.cast(total / n, variable.dtype))
    metrics = sums[len(stats):len(stats) + len(shares)]
    if multi_worker:
        steps = tf.shape(worker_losses)[0]
        return (sums[-1][:steps], tf.cast(sums[-1][steps], stop_vote.dtype),
                tf.cast(tf.reshape(sums[-1][steps + 1:], [2, workers]), tf.float64), metrics)
    return worker_losses, stop_vote, spent[:, None], metrics
