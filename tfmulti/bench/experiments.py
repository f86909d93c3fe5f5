"""The book's automatic-parallelism experiments (`bench parallel`, `bench overlap`).

TensorFlow runs the independent parts of one graph at once on their devices, so "at the same
time" here means: in one tf.function, with nothing forcing an order between them. Every
figure: warm-up runs, an explicit wait for every result, `repeats` timed runs, median and
spread (measure.timed).
"""
import numpy as np
import tensorflow as tf

from tfmulti.bench.measure import timed


def chain_input(size, device, seed=0):
    """A matrix whose powers neither blow up nor vanish (entries average 1/size), so a chain
    of products stays finite at any length."""
    with tf.device(device):
        return tf.random.stateless_uniform((size, size), seed=[seed, 1]) * (2.0 / size)


def chain(x, products):
    """x, x^2, ..., x^products: each product waits for the one before (no merging)."""
    results, y = [], x
    for _ in range(products):
        y = tf.matmul(y, x)
        results.append(y)
    return results


def corners(tensors):
    """One element of each tensor: fetching it waits for all of them, copies almost nothing."""
    return tf.stack([t[0, 0] for t in tensors])


def parallel(devices, size, products, repeats=5, warmup=1):
    """Chains on device 1, on device 2, then on both in one graph with no order between them."""
    xs = [chain_input(size, d, seed=i) for i, d in enumerate(devices[:2])]

    def on(device):
        @tf.function
        def run(x):
            with tf.device(device):
                return corners(chain(x, products))
        return run

    one, two = on(devices[0]), on(devices[1])

    @tf.function
    def both(x1, x2):
        with tf.device(devices[0]):
            a = corners(chain(x1, products))
        with tf.device(devices[1]):
            b = corners(chain(x2, products))
        return a, b

    first = timed(lambda: one(xs[0]).numpy(), repeats, warmup)
    second = timed(lambda: two(xs[1]).numpy(), repeats, warmup)
    together = timed(lambda: [t.numpy() for t in both(*xs)], repeats, warmup)
    a, b = both(*xs)  # the same work as apart, or the comparison means nothing
    same = bool(np.allclose(a, one(xs[0])) and np.allclose(b, two(xs[1])))
    return {"device_1": first, "device_2": second, "both": together, "same_results": same,
            "both_over_sum": together["median_s"] / (first["median_s"] + second["median_s"])}


def overlap(device, host, size, products, repeats=5, warmup=1):
    """Compute on `device`; copy every result to `host` after, or as each becomes ready."""
    x = chain_input(size, device)

    @tf.function
    def compute(x):
        with tf.device(device):
            return chain(x, products)

    @tf.function
    def copy(ys):
        with tf.device(host):
            return corners([tf.identity(y) for y in ys])

    @tf.function
    def compute_and_copy(x):
        with tf.device(device):
            ys = chain(x, products)
        with tf.device(host):  # each copy starts when its product is ready
            return corners([tf.identity(y) for y in ys])

    results = compute(x)
    computing = timed(lambda: compute(x)[-1][0, 0].numpy(), repeats, warmup)
    copying = timed(lambda: copy(results).numpy(), repeats, warmup)
    both = timed(lambda: compute_and_copy(x).numpy(), repeats, warmup)
    separate = computing["median_s"] + copying["median_s"]
    same = bool(np.allclose(compute_and_copy(x), corners(results)))
    return {"compute": computing, "copy": copying, "compute_and_copy": both, "same_results": same,
            "overlap_gain": separate / both["median_s"],
            "copy_hidden": (separate - both["median_s"]) / copying["median_s"]}


def show(label, t):
    print(f"  {label:28} {t['median_s'] * 1e3:9.1f} ms  ({t['min_s'] * 1e3:.1f}-"
          f"{t['max_s'] * 1e3:.1f})")


def run(command, plan, size, products, repeats, warmup):
    """`bench parallel` or `bench overlap` on the plan's (started) devices: prints the
    figures, returns them. On the CPU, overlap computes on the second logical device and
    copies to /CPU:0, the host."""
    print(f"{command}: {products} products of {size}x{size} on {plan.devices}, "
          f"{repeats} repeats (median, min-max)")
    if command == "parallel":
        result = parallel(plan.devices, size, products, repeats, warmup)
        show(f"{plan.devices[0]} alone", result["device_1"])
        show(f"{plan.devices[1]} alone", result["device_2"])
        show("both at once", result["both"])
        print(f"  both / (sum of the two): {result['both_over_sum']:.2f}")
        return result
    device = plan.devices[1] if plan.kind == "cpu" else plan.devices[0]
    result = overlap(device, "/CPU:0", size, products, repeats, warmup)
    show(f"compute on {device}", result["compute"])
    show("copy to /CPU:0 afterwards", result["copy"])
    show("compute, copy as ready", result["compute_and_copy"])
    print(f"  overlap gain (compute + copy) / together: {result['overlap_gain']:.2f}; "
          f"copy time hidden: {result['copy_hidden']:.0%}")
    return result
