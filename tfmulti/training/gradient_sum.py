"""The gradients' sum across replicas and workers, taken by the engine, in 16 bits with
--allreduce_dtype.

Keras 3 sums the replicas' gradients inside the optimizer (`_all_reduce_sum_gradients`),
always in their own dtype, where nothing can time it. The engine sums them before handing
them to the optimizer (`summed`, one all-reduce, each float gradient cast to the wire dtype
and back after: half the bytes on the link, the sum rounded to 16 bits; tests/test_engine.py
bounds the difference from float32's step), and `take_over` turns the optimizer's own sum off.
"""
import keras
import tensorflow as tf

from tfmulti.errors import UsageError


def summed(grads, dtype=tf.float32):
    """The sum over every replica of each gradient (None stays None), in ONE all-reduce, each
    float gradient wider than `dtype` crossing in `dtype` and cast back after (half the bytes
    on the link in 16 bits; the sum is then rounded to 16 bits)."""
    context = tf.distribute.get_replica_context()
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        raise ValueError("No gradients provided for any variable.")

    def wire(g):
        narrower = g.dtype.is_floating and g.dtype.size > dtype.size
        return tf.cast(g, dtype) if narrower else g

    sums = context.all_reduce(tf.distribute.ReduceOp.SUM, [wire(grads[i]) for i in present])
    total = list(grads)
    for i, s in zip(present, sums):
        total[i] = tf.cast(s, grads[i].dtype)  # no op when it was not narrowed
    return total


def check_wire(dtype, devices):
    """TensorFlow drives NCCL (MirroredStrategy's NcclAllReduce between GPUs, and the
    collectives between GPU workers) through one manager that sums float16, float32, float64,
    int32 and int64, not bfloat16: that choice stops at start-up with one line instead of
    failing in the first step."""
    if dtype == "bfloat16" and any("GPU" in d.upper() for d in devices):
        raise UsageError("--allreduce_dtype=bfloat16 on GPUs: TensorFlow's NCCL all-reduce "
                         "does not sum bfloat16; use --allreduce_dtype=float16")


def take_over(optimizer):
    """Makes `optimizer` (or the one a LossScaleOptimizer wraps) apply the gradients it is
    given without summing them across replicas: the engine sums them itself (summed), so that
    the sum can be timed and crosses in --allreduce_dtype. Keras 3 sums them in
    `_all_reduce_sum_gradients`; a Keras without that method would sum them a second time,
    so it stops here with one line."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not callable(getattr(inner, "_all_reduce_sum_gradients", None)):
        raise UsageError(f"this Keras ({keras.__version__}) sums the gradients where tfmulti "
                         "cannot take the sum over (no _all_reduce_sum_gradients); install "
                         "a Keras 3 of the range setup.py names")
    object.__setattr__(inner, "_all_reduce_sum_gradients", list)
