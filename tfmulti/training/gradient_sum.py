"""--allreduce_dtype: the gradients cross replicas and workers in 16 bits.

Keras 3 sums the replicas' gradients in the optimizer (`_all_reduce_sum_gradients`), always in
their own dtype. `compress` replaces that sum with one that casts each float gradient to the
wire dtype for the all-reduce and back after: half the bytes on the link, the sum rounded to
16 bits (tests/test_engine.py bounds the difference from float32's step).
"""
import keras
import tensorflow as tf

from tfmulti.errors import UsageError


def _summed_in(dtype, grads_and_vars):
    """Keras's gradient sum across replicas, with each float gradient wider than `dtype` cast
    to it for the all-reduce and back after: half the bytes on the link in 16 bits."""
    pairs = list(grads_and_vars)
    context = tf.distribute.get_replica_context()
    if context is None:  # cross-replica: nothing to sum (Keras's own rule)
        return pairs
    present = [i for i, (g, _) in enumerate(pairs) if g is not None]
    if not present:
        raise ValueError("No gradients provided for any variable.")

    def wire(g):
        narrower = isinstance(g, tf.Tensor) and g.dtype.is_floating and g.dtype.size > dtype.size
        return tf.cast(g, dtype) if narrower else g

    sums = context.all_reduce(tf.distribute.ReduceOp.SUM, [wire(pairs[i][0]) for i in present])
    for i, total in zip(present, sums):
        g, v = pairs[i]
        pairs[i] = (tf.cast(total, g.dtype), v)  # no op when it was not narrowed
    return pairs


def check_wire(dtype, devices):
    """TensorFlow drives NCCL (MirroredStrategy's NcclAllReduce between GPUs, and the
    collectives between GPU workers) through one manager that sums float16, float32, float64,
    int32 and int64, not bfloat16: that choice stops at start-up with one line instead of
    failing in the first step."""
    if dtype == "bfloat16" and any("GPU" in d.upper() for d in devices):
        raise UsageError("--allreduce_dtype=bfloat16 on GPUs: TensorFlow's NCCL all-reduce "
                         "does not sum bfloat16; use --allreduce_dtype=float16")


def compress(optimizer, dtype):
    """Makes `optimizer` (or the one a LossScaleOptimizer wraps, which sums the unscaled
    gradients) all-reduce its gradients in `dtype`. Keras 3 sums them in
    `_all_reduce_sum_gradients` and has no option for the wire format; a Keras without that
    method stops here, not silently in float32."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not callable(getattr(inner, "_all_reduce_sum_gradients", None)):
        raise UsageError(f"--allreduce_dtype={dtype}: this Keras ({keras.__version__}) has no "
                         "gradient sum to replace; use --allreduce_dtype=float32")
    object.__setattr__(inner, "_all_reduce_sum_gradients",
                       lambda grads_and_vars: _summed_in(tf.as_dtype(dtype), grads_and_vars))
