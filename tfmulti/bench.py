"""The book's automatic-parallelism experiments, and a scaling sweep of the main job.

    python -m tfmulti.bench parallel --num_gpus=2            # two devices at once
    python -m tfmulti.bench overlap --num_gpus=1             # compute overlapped with copies
    python -m tfmulti.bench scaling --num_gpus=8             # 1, 2, 4, 8 replicas
    python -m tfmulti.bench parallel --cpu_replicas=2        # the same on logical CPU devices
    python -m tfmulti.bench predict --inter_link=eth100      # N devices on M machines, predicted

Every figure: warm-up runs, an explicit wait for every result, `--repeats` timed runs, median
and spread. The JSON (with flags, devices and versions) and, for scaling, a PNG plot go to
--out. TensorFlow runs the independent parts of one graph at once on their devices, so "at the
same time" here means: in one tf.function, with nothing forcing an order between them.
"""
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

from tfmulti import cli  # first: as `python -m tfmulti.bench` it imports TensorFlow quietly
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti.run.plan import run_plan  # noqa: E402

COMMANDS = ("parallel", "overlap", "scaling", "predict")


# ----------------------------------------------------------------------------- timing

def timed(fn, repeats=5, warmup=1):
    """Median and spread of fn()'s wall time; fn must wait for its own results."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "samples_s": samples}


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


# ----------------------------------------------------------------------------- experiments

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


def training_rate(strategy, model="resnet18", width=None, per_replica_batch_size=64, steps=10,
                  dtype="float32", repeats=3, warmup=1, allreduce_dtype="float32", step_times=0):
    """Images/s of the main job's training steps (engine and input pipeline), per repeat;
    then the seconds of `step_times` single steps, one call each."""
    from tfmulti.performance import measure

    call, eng = measure.training_call(strategy, model, width, per_replica_batch_size, steps,
                                       dtype, allreduce_dtype)
    result = timed(lambda: call(steps), repeats, warmup)
    global_batch = per_replica_batch_size * strategy.num_replicas_in_sync
    result["images_per_s"] = [steps * global_batch / t for t in result["samples_s"]]
    result["step_times_s"] = [call(1) for _ in range(step_times)]
    from tfmulti.performance import stepmodel

    result["gradient_bytes"] = stepmodel.Model.of_keras(eng.model).gradient_bytes
    return result


# ----------------------------------------------------------------------------- scaling

def replica_counts(largest):
    counts, n = [], 1
    while n < largest:
        counts.append(n)
        n *= 2
    return counts + [largest]


def scaling_table(points):
    """Speed-up and efficiency against the 1-replica point."""
    base = points[0]["images_per_s"]
    for point in points:
        point["speedup"] = point["images_per_s"] / base
        point["efficiency"] = point["speedup"] / point["replicas"] * points[0]["replicas"]
    return points


def plot_scaling(points, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replicas = [p["replicas"] for p in points]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(replicas, [p["speedup"] for p in points], "o-", label="measured")
    ax.plot(replicas, replicas, "--", color="gray", label="linear")
    ax.set(xlabel="replicas", ylabel="speed-up (images/s over 1 replica)", xticks=replicas)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- entry point

def _environment(plan):
    from tfmulti.training import report

    return {"flags": cli.flag_values("bench"), "command": cli.command(),
            "devices": plan.devices, "versions": report.versions(), "cpu_cores": os.cpu_count()}


def _write(out, name, payload):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def _show(label, t):
    print(f"  {label:28} {t['median_s'] * 1e3:9.1f} ms  ({t['min_s'] * 1e3:.1f}-"
          f"{t['max_s'] * 1e3:.1f})")


def main(command):
    from tfmulti.distribution import devices
    from tfmulti.errors import UsageError

    FLAGS = cli.FLAGS
    cfg = cli.run_config()
    plan = cli.device_plan(cfg)
    if FLAGS.repeats < 1 or FLAGS.warmup < 0 or FLAGS.products < 1 or FLAGS.matrix_size < 0:
        raise UsageError("--repeats and --products must be at least 1, --warmup and "
                         "--matrix_size not negative")
    out = FLAGS.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-bench-{command}")
    size = FLAGS.matrix_size or (4000 if plan.kind == "gpu" else 1024)
    if command == "scaling":
        return scaling(plan, cfg, out)
    if command == "predict":
        return predict_scaling(plan, cfg, out)
    if command == "parallel" and plan.count < 2:
        raise UsageError("parallel needs two devices: --num_gpus=2, or --cpu_replicas=2 on the CPU")
    if command == "overlap" and plan.kind == "cpu" and plan.count < 2:
        raise UsageError("overlap on the CPU needs a device apart from the host: --cpu_replicas=2")
    cli.start_devices(plan, cfg)
    devices.check_configured(plan)
    info = _environment(plan)
    print(f"{command}: {FLAGS.products} products of {size}x{size} on {plan.devices}, "
          f"{FLAGS.repeats} repeats (median, min-max)")
    if command == "parallel":
        result = parallel(plan.devices, size, FLAGS.products, FLAGS.repeats, FLAGS.warmup)
        _show(f"{plan.devices[0]} alone", result["device_1"])
        _show(f"{plan.devices[1]} alone", result["device_2"])
        _show("both at once", result["both"])
        print(f"  both / (sum of the two): {result['both_over_sum']:.2f}")
    else:
        device = plan.devices[1] if plan.kind == "cpu" else plan.devices[0]
        result = overlap(device, "/CPU:0", size, FLAGS.products, FLAGS.repeats, FLAGS.warmup)
        _show(f"compute on {device}", result["compute"])
        _show("copy to /CPU:0 afterwards", result["copy"])
        _show("compute, copy as ready", result["compute_and_copy"])
        print(f"  overlap gain (compute + copy) / together: {result['overlap_gain']:.2f}; "
              f"copy time hidden: {result['copy_hidden']:.0%}")
    path = _write(out, f"{command}.json", {**info, "matrix_size": size,
                                           "products": FLAGS.products, "result": result})
    print(f"saved {path}")


def scaling(plan, cfg, out):
    """Each replica count in a fresh process (logical devices and thread pools are fixed at
    start-up), the same per-replica batch in each: images/s, speed-up, efficiency."""
    from tfmulti.errors import UserError

    FLAGS = cli.FLAGS
    if cfg.per_replica_batch_size is None and cfg.global_batch_size is None:
        cfg = dataclasses.replace(cfg, per_replica_batch_size=64)
    per_replica = run_plan(cfg, plan.count).per_replica_batch_size
    points = []
    flag = "--num_gpus" if plan.kind == "gpu" else "--cpu_replicas"
    for count in replica_counts(plan.count):
        args = [sys.executable, "-m", "tfmulti.bench", "scaling_point", f"{flag}={count}",
                f"--per_replica_batch_size={per_replica}", f"--model={cfg.model}",
                f"--width={cfg.width}", f"--dtype={cfg.dtype}", f"--steps={FLAGS.steps}",
                f"--repeats={FLAGS.repeats}", f"--warmup={FLAGS.warmup}"]
        print(f"  {count} replica(s)...", flush=True)
        child = subprocess.run(args, capture_output=True, text=True)
        if child.returncode:
            lines = child.stderr.strip().splitlines() or ["no output"]
            raise UserError(f"the {count}-replica point failed: {lines[-1]}")
        point = json.loads(child.stdout.split("POINT ", 1)[1])
        points.append(point)
    scaling_table(points)
    print(f"{'replicas':>8} {'images/s':>10} {'speed-up':>9} {'efficiency':>11}")
    for p in points:
        print(f"{p['replicas']:>8} {p['images_per_s']:>10.1f} {p['speedup']:>9.2f} "
              f"{p['efficiency']:>11.0%}")
    os.makedirs(out, exist_ok=True)
    plot_scaling(points, os.path.join(out, "scaling.png"),
                 f"{cfg.model} (width {cfg.width}), {per_replica} per replica, "
                 f"{plan.kind.upper()}")
    path = _write(out, "scaling.json", {**_environment(plan), "per_replica_batch_size":
                                        per_replica, "points": points})
    print(f"saved {path} and scaling.png")


def predict_scaling(plan, cfg, out):
    """Measures one device here (and the link between this plan's replicas), predicts the
    --predict_devices x --predict_machines grid, recommends batch, steps per call, dtype."""
    from tfmulti.distribution import devices
    from tfmulti.performance import measure, stepmodel
    from tfmulti.errors import UsageError

    FLAGS = cli.FLAGS
    batch = cfg.per_replica_batch_size or 64
    try:
        grid = ([int(n) for n in FLAGS.predict_devices], [int(m) for m in FLAGS.predict_machines])
    except ValueError:
        raise UsageError("--predict_devices and --predict_machines take whole numbers, comma "
                         "separated") from None
    try:
        inter = stepmodel.link(FLAGS.inter_link)
        intra = stepmodel.link(FLAGS.intra_link) if FLAGS.intra_link else None
    except ValueError as e:
        raise UsageError(f"--intra_link/--inter_link: {e}") from None
    if min(grid[0] + grid[1]) < 1 or not 0 <= FLAGS.overlap <= 1 or FLAGS.steps < 2:
        raise UsageError("--predict_devices and --predict_machines must be at least 1, "
                         "--overlap between 0 and 1, --steps at least 2")
    cores = devices.usable_cores()
    if plan.kind == "gpu":
        cli.start_devices(plan, cfg)
    else:  # the measured device gets every core: CPU replicas share them
        devices.configure(plan, cores)
    device = plan.devices[0]
    one = tf.distribute.OneDeviceStrategy(device)
    print(f"measuring {cfg.model} (width {cfg.width}), {cfg.dtype}, batch {batch} and "
          f"{2 * batch} on {device}" + (f" ({cores} cores)" if plan.kind == "cpu" else ""),
          flush=True)
    measured = measure.measure(one, device, cfg.model, cfg.width, cfg.dtype, batch,
                                FLAGS.steps)
    if intra is None:
        intra = (measure.measured_link(devices.make_strategy(plan)) if plan.count > 1
                 else stepmodel.LINKS["pcie3"])

    def setup_for(n, m):
        return stepmodel.Setup(devices=n, machines=m, intra=intra, inter=inter,
                             algorithm=FLAGS.collective, overlap=FLAGS.overlap,
                             steps_per_call=cfg.steps_per_call,
                             call_overhead_s=measured["call_overhead_s"])

    compute, model, rows = measure.table(measured, plan.kind == "cpu", setup_for, *grid,
                                          cfg.allreduce_dtype)
    double = 2 * batch / measured["step_s_double_batch"]
    print(f"one {plan.kind.upper()} device here: {batch / measured['step_s']:.1f} images/s at "
          f"batch {batch} ({measured['step_s'] * 1e3:.1f} ms a step), {double:.1f} at "
          f"{2 * batch}; host round trip {measured['call_overhead_s'] * 1e3:.2f} ms a call; "
          f"gradients {model.gradient_bytes / 1e6:.1f} MB ({cfg.allreduce_dtype}) in "
          f"{model.tensors} tensors")
    print(f"links: inside a machine {intra.name} ({intra.gbytes_per_s:.2f} GB/s, "
          f"{intra.latency_s * 1e6:.0f} us a hop); between machines {inter.name} "
          f"({inter.gbytes_per_s:.2f} GB/s, {inter.latency_s * 1e6:.0f} us); {FLAGS.collective}, "
          f"overlap {FLAGS.overlap:g}" + ("; CPU devices share the cores" if plan.kind == "cpu"
                                          else ""))
    print(measure.format_rows(rows))
    largest = setup_for(max(grid[0]), max(grid[1]))
    best_batch = stepmodel.recommend_batch(compute, model, largest)
    step = stepmodel.predict(compute, model, largest, batch)
    advice = "; ".join(a for a in (
        stepmodel.dtype_advice(measured["float32_gflops"], measured["bfloat16_gflops"], cfg.dtype),
        stepmodel.allreduce_advice(compute, model, largest, batch, cfg.allreduce_dtype)) if a)
    print(f"recommended at {max(grid[1])} x {max(grid[0])}: per-device batch "
          f"{best_batch or 'none keeps 90% efficiency'}"
          f"{' (90% efficiency)' if best_batch else ''}, --steps_per_call="
          f"{stepmodel.recommend_steps_per_call(largest, sum(step.terms.values()))}; matmul "
          f"{measured['float32_gflops']:.0f} GFLOP/s float32, "
          f"{measured['bfloat16_gflops']:.0f} bfloat16 here"
          + (f"; {advice}" if advice else ""))
    path = _write(out, "predict.json", {**_environment(plan), "measured": measured, "rows": [
        dataclasses.asdict(r) for r in rows], "recommended_batch": best_batch})
    print(f"saved {path}")


def scaling_point():
    """One point of the sweep, run in its own process; prints POINT {json}. With
    --worker_hosts it is one worker of a multi-worker point (benchmarks/multiworker.py)."""
    from tfmulti.distribution import allocator, devices

    FLAGS = cli.FLAGS
    cfg = cli.run_config()
    cluster = devices.cluster_config(cfg.worker_hosts, cfg.task_index)
    plan = cli.device_plan(cfg)
    cli.start_devices(plan, cfg)
    strategy = (devices.make_multi_worker_strategy(cluster, plan) if cluster
                else devices.make_strategy(plan))
    per_replica = run_plan(cfg, strategy.num_replicas_in_sync).per_replica_batch_size
    result = training_rate(strategy, cfg.model, cfg.width, per_replica,
                           FLAGS.steps, cfg.dtype, FLAGS.repeats, FLAGS.warmup,
                           cfg.allreduce_dtype, FLAGS.step_times)
    point = {"replicas": strategy.num_replicas_in_sync, "devices": devices.replica_names(strategy),
             "images_per_s": statistics.median(result["images_per_s"]),
             "samples_images_per_s": result["images_per_s"],
             "gradient_bytes": result["gradient_bytes"], "step_times_s": result["step_times_s"],
             "malloc": allocator.loaded_malloc()}
    if FLAGS.link_mb and strategy.num_replicas_in_sync > 1:  # the link the gradients take
        from tfmulti.performance import measure

        link = measure.measured_link(strategy, FLAGS.link_mb)
        point["link"] = {"gbytes_per_s": link.gbytes_per_s, "latency_s": link.latency_s}
    print("POINT " + json.dumps(point))


def _dispatch(command):
    if command == "scaling_point":
        return scaling_point()
    return main(command)


if __name__ == "__main__":
    cli.run(_dispatch, "bench", commands=COMMANDS + ("scaling_point",))
