"""The scaling sweep (`bench scaling`): the main job's images/s at 1, 2, 4, ... replicas, each
count in a fresh process (`bench scaling_point`: logical devices and thread pools are fixed
at start-up), the same per-replica batch in each; speed-up, efficiency and a plot.
"""
import json
import statistics
import sys
import tempfile

from tfmulti.bench import measure, stepmodel
from tfmulti.distribution import allocator
from tfmulti.errors import UserError
from tfmulti.processes import supervisor


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


def training_rate(strategy, model="resnet18", width=None, per_replica_batch_size=64, steps=10,
                  dtype="float32", repeats=3, warmup=1, allreduce_dtype="float32", step_times=0):
    """Images/s of the main job's training steps (engine and input pipeline), per repeat;
    then the seconds of `step_times` single steps, one call each."""
    call, eng = measure.training_call(strategy, model, width, per_replica_batch_size, steps,
                                      dtype, allreduce_dtype)
    result = measure.timed(lambda: call(steps), repeats, warmup)
    global_batch = per_replica_batch_size * strategy.num_replicas_in_sync
    result["images_per_s"] = [steps * global_batch / t for t in result["samples_s"]]
    result["step_times_s"] = [call(1) for _ in range(step_times)]
    result["gradient_bytes"] = stepmodel.Model.of_keras(eng.model).gradient_bytes
    return result


def point(strategy, replica_names, cfg, per_replica, steps, repeats, warmup, step_times=0,
          link_mb=0.0):
    """One point of the sweep on `strategy`'s replicas (a dict JSON can hold); with link_mb,
    also the link the gradients take (all-reduces of one number and of link_mb megabytes)."""
    result = training_rate(strategy, cfg.model, cfg.width, per_replica, steps, cfg.dtype,
                           repeats, warmup, cfg.allreduce_dtype, step_times)
    found = {"replicas": strategy.num_replicas_in_sync, "devices": replica_names,
             "images_per_s": statistics.median(result["images_per_s"]),
             "samples_images_per_s": result["images_per_s"],
             "gradient_bytes": result["gradient_bytes"], "step_times_s": result["step_times_s"],
             "malloc": allocator.loaded_malloc()}
    if link_mb and strategy.num_replicas_in_sync > 1:
        link = measure.measured_link(strategy, link_mb)
        found["link"] = {"gbytes_per_s": link.gbytes_per_s, "latency_s": link.latency_s}
    return found


POINT_SECONDS = 1800  # one point's time limit: its process is stopped after it


def sweep(plan, cfg, per_replica, steps, repeats, warmup, timeout=POINT_SECONDS):
    """Each replica count of the plan in a process of its own (`bench scaling_point`, under
    the supervisor: it dies with this one, has the malloc preloaded, and is stopped after
    `timeout` s); prints the table, returns the points with their speed-up and efficiency."""
    flag = "--num_gpus" if plan.kind == "gpu" else "--cpu_replicas"
    points = []
    for count in replica_counts(plan.count):
        args = [sys.executable, "-m", "tfmulti.bench", "scaling_point", f"{flag}={count}",
                f"--per_replica_batch_size={per_replica}", f"--model={cfg.model}",
                f"--width={cfg.width}", f"--dtype={cfg.dtype}", f"--steps={steps}",
                f"--repeats={repeats}", f"--warmup={warmup}"]
        print(f"  {count} replica(s)...", flush=True)
        with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
            with supervisor.Supervisor(lambda line: None, noun="point") as group:
                point = group.start(f"the {count}-replica point", args, log=log.name)
                failed, _, late = group.watch(grace=0, timeout=timeout)
            text = log.read()
        if late or failed is not None or "POINT " not in text:
            why = (f"no result in {timeout:g} s" if late else
                   (text.strip().splitlines() or ["no output"])[-1])
            raise UserError(f"the {count}-replica point failed (exit code "
                            f"{supervisor.shell_code(point.poll())}): {why}")
        points.append(json.loads(text.split("POINT ", 1)[1].splitlines()[0]))
    scaling_table(points)
    print(f"{'replicas':>8} {'images/s':>10} {'speed-up':>9} {'efficiency':>11}")
    for p in points:
        print(f"{p['replicas']:>8} {p['images_per_s']:>10.1f} {p['speedup']:>9.2f} "
              f"{p['efficiency']:>11.0%}")
    return points
