"""Each replica's part of the engine's training step: its forward and backward pass (compiled
with XLA or not), its micro-batches, the sum of the gradients over every replica and the
update. The engine runs it on every replica (`strategy.run`) inside its traced call."""
import keras
import tensorflow as tf

from tfmulti.accounting import timing
from tfmulti.models import task as tasks
from tfmulti.training import gradient_sum, xla


class ReplicaStep:
    """A replica's step of `model` (its tasks.Task `task`, `optimizer`): the loss averaged
    over the GLOBAL batch, the gradients summed in one all-reduce in `allreduce_dtype`,
    `figures` (trainfigures.TrainFigures) counting each batch. grad_accum_steps: the
    replica's batch taken in that many micro-batches."""

    def __init__(self, strategy: tf.distribute.Strategy, model: keras.Model, task: tasks.Task,
                 optimizer: keras.optimizers.Optimizer, figures, global_batch_size: int,
                 grad_accum_steps: int, allreduce_dtype: tf.DType):
        self.strategy, self.model, self.task, self.optimizer = strategy, model, task, optimizer
        self.figures, self.global_batch_size = figures, global_batch_size
        self.grad_accum_steps, self.allreduce_dtype = grad_accum_steps, allreduce_dtype
        self.use_xla(False)

    def use_xla(self, on: bool) -> None:
        """The forward and backward pass compiled with XLA (on) or not, where next traced."""
        self.jit_compile = bool(on)
        self.forward_backward = (tf.function(self.forward_backward_fn, jit_compile=True)
                                 if on else self.forward_backward_fn)

    def forward_backward_fn(self, features, targets, *weights):
        """(gradients of the loss scaled for float16, this replica's share of the global mean
        loss, each example's loss, the outputs, the sum of the model's own losses or None):
        the replica's own computation, which --jit_compile compiles with XLA. weights: each
        example's (your sample or class weights; none given: each weighs 1), its loss
        multiplied by it as Keras's sum-over-batch-size losses do (the mean of weight x loss
        over the batch)."""
        with tf.GradientTape() as tape:
            outputs = self.model(features, training=True)
            per_example = self.task.per_example_loss(targets, outputs)
            for weight in weights:  # (weights,) or ()
                per_example *= tf.cast(weight, per_example.dtype)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=self.global_batch_size)
            added = None  # the model's own losses (weight regularizers, activity losses,
            if self.model.losses:  # add_loss): once per step
                added = tasks.added_losses(self.model.losses)
                loss += tf.nn.scale_regularization_loss(added) / self.grad_accum_steps
            scaled = self.optimizer.scale_loss(loss)
        return (tape.gradient(scaled, self.model.trainable_variables), loss, per_example,
                outputs, added)

    def gradients(self, features, targets, weights=None):
        """(gradients of the loss scaled for float16, this replica's share of the global mean
        loss) for one batch or micro-batch; the figures count its examples (weighed by
        `weights`, as fit's compiled metrics weigh them)."""
        with tf.name_scope(xla.COMPILED_PASS):  # names the pass in the errors of its compile
            grads, loss, per_example, outputs, added = self.forward_backward(
                features, targets, *(() if weights is None else (weights,)))
        self.figures.update(per_example, added, targets, outputs, weights)
        return grads, loss

    def step(self, batch):
        """One step on every local replica, inside the engine's training call: (this
        worker's share of the global mean loss, each local replica's clock when its
        gradients were ready, and when they were summed, None: no logs of its own)."""
        shares, ready, reduced = (self.strategy.experimental_local_results(part) for part
                                  in self.strategy.run(self, args=batch))
        return tf.add_n([tf.cast(v, tf.float32) for v in shares]), ready, reduced, None

    def __call__(self, features, targets, weights=None):
        """(this replica's share of the global mean loss, the clock when its gradients were
        there, the clock when their sum over every replica was back).

        The gradients are summed (one all-reduce; the optimizer's own sum is off, see
        gradient_sum.py) before the optimizer sees them, the float16 loss-scaled ones
        included: a gradient that overflowed on any replica makes the sum non-finite on every
        replica, so all skip the step and lower the loss scale together. (Keras's
        LossScaleOptimizer checks each replica's own gradients before its sum and applies
        replica 0's answer to all, or each worker its own: an overflow on replica 1 alone was
        summed into every replica's weights, and across workers one skipped while another
        waited in the all-reduce.)"""
        if self.grad_accum_steps == 1:
            grads, loss = self.gradients(features, targets, weights)
        else:
            grads, loss = self.accumulated(features, targets, weights)
        ready = timing.clock_after(grads)
        if self.strategy.num_replicas_in_sync == 1:  # nothing to sum, nothing crosses: each
            # variable's update may start as its gradient is there (5% of a ResNet-18 step)
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
            return loss, ready, ready
        grads = gradient_sum.summed(grads, self.allreduce_dtype)
        reduced = timing.clock_after(grads)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss, ready, reduced

    def accumulated(self, features, targets, weights=None):
        """The sum of the gradients of grad_accum_steps consecutive micro-batches, one after
        the other (a while loop: one micro-batch's activations alive at a time). Each loss is
        already a share of the global mean, so the sum is the whole batch's gradient."""
        k = self.grad_accum_steps
        micro = tf.shape(tf.nest.flatten(features)[0])[0] // k
        variables = self.model.trainable_variables
        total = [tf.zeros_like(v.value) for v in variables]
        loss = tf.constant(0.0, tf.float32)
        for i in tf.range(k):
            start = i * micro
            grads, share = self.gradients(*tf.nest.map_structure(
                lambda a: a[start:start + micro],
                (features, targets) if weights is None else (features, targets, weights)))
            total = [t + tf.cast(g, t.dtype) for t, g in zip(total, grads)]
            loss += tf.cast(share, tf.float32)
        return total, loss
