"""The custom training loop: one engine for OneDevice, Mirrored and MultiWorkerMirrored runs.

Why not `model.fit`: under MultiWorkerMirroredStrategy Keras 3's fit fails, while
`strategy.run` inside a `tf.function` works under every strategy (see docs/main-job.md, Engine
section). Several steps run per `tf.function` call (fewer host round trips), the loss is averaged
over the GLOBAL batch (the engine sums the replicas' gradients in one all-reduce), and
evaluation weighs every test example exactly once.
"""
import functools

import keras
import numpy as np
import tensorflow as tf

from tfmulti import tfprivate
from tfmulti.accounting import timing
from tfmulti.distribution import workers
from tfmulti.errors import UsageError
from tfmulti.models import ownstep, task, usermodel
from tfmulti.training import (
    callsync,
    checkpointed,
    compiled,
    epoch_metrics,
    evalsteps,
    gradient_sum,
    ownsteps,
    replicastep,
    trainfigures,
    xla,
)


class Engine:
    """Builds the model and optimizer inside `strategy.scope()` and trains them.

    model_fn(): builds the Keras model. optimizer_fn(step): the optimizer, its learning rate
    read from `step`, the engine's step variable (see optim.py). Both run in the strategy scope.
    grad_accum_steps: each replica's batch is taken in that many micro-batches, their
    gradients summed before one update (the same update, batch norm aside).
    allreduce_dtype: the gradients cross devices and workers in this dtype (float32, or
    bfloat16 / float16 for half the bytes; the sum is then rounded to it). One replica sums
    nothing: its gradients are not rounded.
    task_fn(model): the task.Task (loss and metrics) of the model, built in the strategy's
    scope; None: a classifier of logits (cross-entropy, accuracy).
    jit_compile: each replica's forward and backward pass compiled with XLA (xla.py).
    """

    def __init__(self, strategy, model_fn, optimizer_fn, global_batch_size,
                 loss_scaling=False, steps_per_call=10, grad_accum_steps=1,
                 allreduce_dtype="float32", task_fn=None, jit_compile=False,
                 spec="your model"):
        if steps_per_call < 1:
            raise UsageError(f"--steps_per_call={steps_per_call}: must be at least 1")
        self.strategy = strategy
        self.global_batch_size = global_batch_size
        self.steps_per_call = steps_per_call
        self.loss_scaling = loss_scaling
        with strategy.scope():
            self.model = model_fn()
            # The model's compiled loss and metrics, or cross-entropy on logits and accuracy
            self.task = task_fn(self.model) if task_fn else task.Task(self.model)
            # The step count, kept by the engine: a step that loss scaling skips does not
            # advance the optimizer's iterations, but it used its batch (data position,
            # checkpoint numbers and the progress bar follow this count).
            self.steps_taken = tf.Variable(0, dtype=tf.int64, trainable=False, name="steps_taken",
                                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            # the optimizer the model was compiled with (None: not compiled), kept before
            # the engine's replaces it as the model's own step's self.optimizer
            self.compiled_optimizer = compiled.own_optimizer(self.model)
            # A model with its own train_step (or compute_loss, ...) trains with Keras's
            # steps, as fit runs them (ownstep.py); the others with the engine's fused step
            self.own_training = usermodel.trains_own(self.model)
            self.own_evaluation = usermodel.evaluates_own(self.model)
            # the optimizers the model's own compile keeps besides the compiled one (a GAN's
            # d_optimizer and g_optimizer): they train it, as it made them
            self.own_optimizers = (ownstep.kept_optimizers(self.model) if self.own_training
                                   else {})
            if self.own_training:
                ownstep.check(self.model, spec, grad_accum_steps, allreduce_dtype)
            optimizer = optimizer_fn(self.steps_taken)
            if loss_scaling:  # float16 gradients underflow without it
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            if self.own_training:  # the step's self.optimizer, which sums the gradients
                self.model.optimizer = optimizer
            else:  # the engine sums the gradients itself (timed, in allreduce_dtype)
                gradient_sum.check_wire(allreduce_dtype, strategy.extended.worker_devices)
                gradient_sum.take_over(optimizer)
            optimizer.build(self.model.trainable_variables)
            self.optimizer = optimizer
            # the training figures of the epoch so far: the engine's step counts them, a
            # model's own train_step returns its logs (self.own, below)
            figures = None if self.own_training else trainfigures.TrainFigures(self.task)
            self.tests = evalsteps.EvalSteps(strategy, self.model, self.task)
        # each replica's part of the engine's step (a model's own step: Keras's, ownsteps.py)
        self.replica = replicastep.ReplicaStep(strategy, self.model, self.task, optimizer,
                                               figures, global_batch_size, grad_accum_steps,
                                               tf.as_dtype(allreduce_dtype))
        # Replicas on other processes: decisions (stop, start step) must then be agreed.
        self._local_replicas = len(strategy.extended.worker_devices)
        self.multi_worker = strategy.num_replicas_in_sync > self._local_replicas
        # the epoch's training metrics so far, kept in the checkpoint with every variable of
        # the model and the optimizer and the step (checkpointed.py, epoch_metrics.py)
        self.epoch_metrics = epoch_metrics.EpochMetrics(lambda: self.figures.variables())
        self.saved = checkpointed.Saved(self.model, self.optimizer, self.steps_taken,
                                        self.epoch_metrics, self.multi_worker)
        resolver = strategy.cluster_resolver if self.multi_worker else None
        self.worker_index = int(resolver.task_id or 0) if resolver else 0  # this worker's
        # the first call with XLA falls back without it if its compile fails (xla.py)
        self.xla_fallback = xla.Fallback(strategy, self._call_state, lambda: self.use_xla(False),
                                         self.multi_worker, self.worker_index)
        self.use_xla(jit_compile)
        self.any_worker = workers.AnyWorker(strategy)  # whether a flag is true on any worker
        self.workers = strategy.num_replicas_in_sync // self._local_replicas
        # the training call as its first call traced it: what accounting/flops.py counts
        # the step's FLOPs and kernels from, for the MFU (None before the first call)
        self.traced_call = None
        # a model's own steps: Keras's state for them, their logs, their evaluation
        self.own = (ownsteps.OwnSteps(strategy, self.model, self.task.targetless,
                                      self.epoch_metrics, self.worker_index)
                    if self.own_training or self.own_evaluation else None)
        self.figures = self.own if self.own_training else figures

    def checkpoint_manager(self, directory, max_to_keep=2):
        """Model, optimizer and (through the optimizer's step) the data position, together,
        with the epoch's training metrics so far (in one process read at each save; across
        workers kept at each call's end, epoch_metrics.py)."""
        return self.saved.manager(directory, max_to_keep)

    @property
    def step(self):
        """Training steps taken so far, skipped ones included (saved in checkpoints)."""
        return int(self.steps_taken.numpy())

    def restore(self, path):
        """Restores the checkpoint at path, checking that it is this model and optimizer
        (AssertionError when it is not); the epoch's training metrics so far where it holds
        them (a checkpoint of an earlier tfmulti does not)."""
        self.saved.restore(path, self.strategy, first_worker=self.worker_index == 0)

    def learning_rate(self):
        """The rate the step trains at: the optimizer's, or the first of those a model's own
        compile keeps (a GAN's: own_optimizers)."""
        optimizer = next(iter(self.own_optimizers.values()), self.optimizer)
        return float(optimizer.learning_rate.numpy())

    # --------------------------------------------------------------- replica functions

    def use_xla(self, on):
        """Each replica's forward and backward pass compiled with XLA (on) or not, from the
        next traced step on (before the first step: the steps are traced at their first
        call)."""
        self.replica.use_xla(on)
        self._train_steps = tf.function(self._train_steps_fn)  # traced again
        self._first_xla_call = self.jit_compile  # XLA's compile not yet proven by a call

    @property
    def jit_compile(self):
        return self.replica.jit_compile

    def take_micro_batches(self, count):
        """Each replica's batch taken in `count` micro-batches from the next traced step on
        (a resume on fewer replicas takes the earlier replicas' batches so:
        lifecycle.replicas_as_micro_batches)."""
        self.replica.grad_accum_steps = count
        self._train_steps = tf.function(self._train_steps_fn)  # traced again

    @property
    def grad_accum_steps(self):
        """Micro-batches per replica batch (--grad_accum_steps)."""
        return self.replica.grad_accum_steps

    def xla_refusal(self, features, targets):
        """'' when XLA compiles each replica's forward and backward pass for this
        per-replica batch; else why not, in one line (no step runs)."""
        return xla.lowering_refusal(self.strategy, self.replica.forward_backward, features,
                                    targets)

    # --------------------------------------------------------------- tf.functions

    def _train_steps_fn(self, iterator, num_steps, stop_votes):
        """Returns each step's global mean loss, so a NaN can be traced to its step, the
        workers' stop votes summed (so every worker stops after the same call), the seconds
        this worker's steps waited for their input, and each worker's seconds computing and
        all-reducing ([2, workers]: timing.py). The steps themselves have one collective
        each, the gradients'; losses, votes, times, batch-norm statistics and, across
        workers, the training metrics' state (for the checkpoint: epoch_metrics.py) are
        reduced together once at the end of the call."""
        losses = tf.TensorArray(tf.float32, size=tf.cast(num_steps, tf.int32))
        waited = tf.constant(0.0, tf.float64)  # s this worker's steps waited for their input
        spent = tf.zeros([2], tf.float64)  # s computing, s all-reducing (this worker)
        done = self.steps_taken.read_value()
        # a model's own step: each step's logs (this worker's sum over the global count)
        logs = tf.TensorArray(tf.float32, size=tf.cast(num_steps, tf.int32))
        for i in tf.range(num_steps):
            with tf.control_dependencies([done]):  # after the previous step, not beside it
                asked = timing.clock()
            with tf.control_dependencies([asked]):
                batch = next(iterator)
            arrived = timing.clock_after(tf.nest.flatten(batch, expand_composites=True),
                                         on_device=False)
            batch = timing.held_until(batch, arrived)  # the step starts after the clock
            waited += arrived - asked
            # the engine's step, or the model's own (ownsteps.py: its logs, meaned as fit does)
            share, ready, reduced, mean = (self.own if self.own_training
                                           else self.replica).step(batch)
            if mean is not None:
                logs = logs.write(tf.cast(i, tf.int32), mean)
            ready, reduced = tf.reduce_max(tf.stack(ready)), tf.reduce_max(tf.stack(reduced))
            spent += tf.stack([ready - arrived, reduced - ready])
            done = self.steps_taken.assign_add(1)
            losses = losses.write(tf.cast(i, tf.int32), share)
        worker_losses = losses.stack()
        if self.own_training:  # the last step's logs ride with the losses (summed by worker)
            worker_losses = tf.concat([worker_losses,
                                       logs.read(tf.cast(num_steps, tf.int32) - 1)], 0)
        if self.strategy.num_replicas_in_sync == 1:
            return worker_losses, stop_votes, spent[:, None], waited
        ends = self.strategy.run(functools.partial(
            callsync.replica_end_of_call, self.strategy, self.model, self.epoch_metrics),
            args=(worker_losses, stop_votes, spent))
        worker_losses, stop_votes, spent, sums = tf.nest.map_structure(
            lambda part: self.strategy.experimental_local_results(part)[0], ends)
        self.epoch_metrics.record(sums)
        return worker_losses, stop_votes, spent, waited

    # --------------------------------------------------------------- host loops

    def distribute(self, dataset_fn):
        """The per-replica batches of dataset_fn for this engine's replicas. One replica on a
        CPU takes the pipeline as it is (strategy.run takes its batches): tf.distribute's
        iterator there costs a large share of a fast step's time (Keras fit, which iterates
        the dataset itself, does not pay it). GPUs keep the strategy's iterator, which
        prefetches the batches onto the device."""
        devices = self.strategy.extended.worker_devices
        if self.strategy.num_replicas_in_sync == 1 and "GPU" not in devices[0].upper():
            return dataset_fn(tf.distribute.InputContext())
        tfprivate.no_autotuning_on_devices()  # freeing the iterator waits for it otherwise
        return self.strategy.distribute_datasets_from_function(dataset_fn)

    def train_steps(self, iterator, num_steps, checkpoint_every=0, stop=None, spent=None):
        """Runs num_steps steps, several per call; yields (steps done, stop) after each call.

        Calls end at multiples of checkpoint_every (counted in global steps), so a run resumed
        from a checkpoint cuts its calls where the uninterrupted run did. stop is true once
        stop() was true before a call, on any worker: every worker sees the same answer after
        the same call (a worker that stopped alone would leave the others waiting in the next
        all-reduce). Raises FloatingPointError naming the first step whose loss is not finite.
        spent (a timing.Spent): each call's seconds waiting for input, computing and
        all-reducing are added to it.
        """
        done = 0
        while done < num_steps:
            n = min(self.steps_per_call, num_steps - done)
            if checkpoint_every:
                n = min(n, checkpoint_every - self.step % checkpoint_every)
            first = self.step + 1
            vote = 1.0 if self.multi_worker and stop is not None and stop() else 0.0
            args = (iterator, tf.constant(n, tf.int64), tf.constant(vote, tf.float64))
            if self.own is not None:
                self.own.build_state(iterator)
            with usermodel.failure_said("training"), self.xla_fallback.around(
                    self._first_xla_call):
                losses, votes, times, waited = self._train_steps(*args)
            self._first_xla_call = False
            if self.traced_call is None:
                self.traced_call = self._train_steps.get_concrete_function(*args)
            losses = losses.numpy()
            if self.own_training:  # the losses, then the last step's logs
                losses, logs = losses[:n], losses[n:]
                self.own.took(logs)
            if spent is not None:
                spent.add(float(waited), times.numpy())
            bad = np.flatnonzero(~np.isfinite(losses))
            if bad.size:
                raise FloatingPointError(f"loss is {losses[bad[0]]} at step {first + bad[0]}")
            done += n
            yield done, (float(votes) > 0 if self.multi_worker else
                         stop is not None and stop())

    def _call_state(self):
        """Every variable a training call may change: the model's (batch norm's statistics
        and random layers' seeds among them), the optimizer's, the step count and the
        training metrics'."""
        return [*self.model.variables, *self.optimizer.variables, self.steps_taken,
                *self.figures.variables(), self.epoch_metrics.sums]

    def reset_train_metrics(self):
        """At each epoch's start: the training figures start again."""
        self.epoch_metrics.clear()
        self.figures.reset()

    def train_results(self):
        """{"loss": the mean loss, metric name: its value} of the training steps since the
        last reset_train_metrics (every worker must read them: a collective); a model's own
        train_step: the logs its last step returned, averaged over the replicas."""
        return self.figures.results()

    @property
    def metric_names(self):
        """The names of the training figures besides the loss: the task's, or those of the
        logs the model's own train_step returned (once it ran)."""
        names = self.figures.names()
        return list(self.task.metric_names) if names is None else names

    def evaluate(self, eval_dataset, num_steps):
        """({"loss": test loss, metric name: its value}, examples counted) over the whole
        evaluation set: the model's own test_step's figures, or the engine's (evalsteps.py)."""
        return (self.own if self.own_evaluation else self.tests).evaluate(eval_dataset,
                                                                          num_steps)
