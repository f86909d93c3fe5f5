"""How far a run on 1 replica drifts from the same run on 2 replicas, step by step: the ground
for what an elastic resume guarantees (docs/faults-and-workers.md, "Resume on another device
count").

    python benchmarks/elastic_drift.py --out=benchmarks/results/elastic_drift.json  # ~2 min

Both runs start from the same weights and take the same global batches (the engine, one step
per call). After each step, the largest difference of any weight, relative to that weight's
largest value. One step on 1 replica and on 2 differ only in the order of the gradient's sums;
what training makes of that difference afterwards depends on the model, the learning rate and
the momentum, not on tfmulti, so each case is also run with its 2-replica run resumed from a
checkpoint at its middle on 2 replicas (0: the resume itself adds nothing).
"""
import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import where_measured  # noqa: E402

CASES = {  # name: (model, width, learning rate, momentum, synchronized batch norm)
    "lenet, lr 0.025 (tfmulti's default at batch 64)": ("lenet", 4, 0.025, 0.0, False),
    "lenet, lr 0.2, momentum 0.9": ("lenet", 4, 0.2, 0.9, False),
    "resnet18 width 4, lr 0.05": ("resnet18", 4, 0.05, 0.0, False),
    "resnet18 width 4, lr 0.05, --sync_batchnorm": ("resnet18", 4, 0.05, 0.0, True),
}


def drift(strategies, dataset, model, width, rate, momentum, sync, steps, global_batch):
    """[relative gap after each step] between the run on 1 replica and on 2, and the gap of
    the 2-replica run restored from its checkpoint at steps // 2 and run on to the end."""
    import keras
    import numpy as np

    from tfmulti.data import pipeline
    from tfmulti.models import zoo
    from tfmulti.training import engine

    def make(strategy):
        return engine.Engine(strategy, lambda: zoo.build(model, width, seed=0, init="book",
                                                       sync_batchnorm=sync),
                             lambda step: keras.optimizers.SGD(rate, momentum=momentum),
                             global_batch, steps_per_call=1)

    def weights_after_each_step(eng, first=0, last=steps, at=None):
        per_replica = global_batch // eng.strategy.num_replicas_in_sync
        fn = pipeline.train_input_fn(dataset.train_features, dataset.train_targets,
                                     per_replica, seed=0, start_step=first)
        out, saved = [], None
        for done, _ in eng.train_steps(iter(eng.distribute(fn)), last - first):
            out.append(eng.model.get_weights())
            if first + done == at:
                saved = eng.saved.whole.save(os.path.join(tempfile.mkdtemp(), "ckpt"))
        return out, saved

    def gap(a, b):
        return (max(float(np.abs(x - y).max()) for x, y in zip(a, b))
                / max(float(np.abs(x).max()) for x in a))

    one, _ = weights_after_each_step(make(strategies[1]))
    two, saved = weights_after_each_step(make(strategies[2]), at=steps // 2)
    resumed = make(strategies[2])
    resumed.restore(saved)
    rest, _ = weights_after_each_step(resumed, first=steps // 2)
    return [gap(b, a) for a, b in zip(one, two)], gap(two[-1], rest[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--global_batch_size", type=int, default=64)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from tfmulti import quiet

    quiet.import_tensorflow()
    import tensorflow as tf

    from tfmulti.data import sources
    from tfmulti.distribution import devices

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    strategies = {n: devices.make_strategy(devices.DevicePlan("cpu", n)) for n in (1, 2)}
    dataset = sources.load("synthetic", synthetic_train_size=args.steps * args.global_batch_size,
                           synthetic_test_size=64, seed=0)
    rows = {}
    for name, case in CASES.items():
        gaps, resumed = drift(strategies, dataset, *case, args.steps, args.global_batch_size)
        rows[name] = {"first_step": gaps[0], "step_8": gaps[7], "step_16": gaps[15],
                      "last_step": gaps[-1], "steps": len(gaps),
                      "two_replicas_resumed_at_half_vs_uninterrupted": resumed}
        print(f"{name}: 1 against 2 replicas after step 1 {gaps[0]:.2g}, 8 {gaps[7]:.2g}, "
              f"16 {gaps[15]:.2g}, {len(gaps)} {gaps[-1]:.2g}; 2 replicas resumed at step "
              f"{args.steps // 2}: {resumed:.2g}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "rows": rows,
                       **where_measured(), "tensorflow": tf.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
