"""One worker of two (argv: index, hosts): float16 training with loss scaling under
MultiWorkerMirroredStrategy, where one worker's batch overflows at chosen steps (worker 1's at
step 1, worker 0's at step 3; steps 2 and 4 are ordinary). Before the first step and after
each, it prints STEP {json}: the step counts, the loss scale and a checksum of the weights.
Used by test_multiworker."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PER_WORKER = 8
OVERFLOWS = {1: 1, 3: 0}  # step -> the worker whose batch overflows


def main(index, hosts):
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts},
                                          "task": {"type": "worker", "index": index}})
    import keras
    import numpy as np
    import tensorflow as tf

    from tfmulti.training import engine, optim

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    def float16_linear():  # no normalisation: large inputs overflow its scaled gradients
        return keras.Sequential([keras.Input((28, 28, 1)),
                                 keras.layers.Flatten(dtype="mixed_float16"),
                                 keras.layers.Dense(10, dtype="mixed_float16")])

    def dataset_fn(ctx):
        rng = np.random.default_rng(ctx.input_pipeline_id)
        images = rng.random((4 * PER_WORKER, 28, 28, 1)).astype("float32")
        for step, worker in OVERFLOWS.items():
            if worker == ctx.input_pipeline_id:
                images[(step - 1) * PER_WORKER:step * PER_WORKER] *= 1000.0
        labels = rng.integers(0, 10, len(images)).astype("int32")
        return tf.data.Dataset.from_tensor_slices((images, labels)).batch(PER_WORKER)

    eng = engine.Engine(strategy, float16_linear, optim.constant(0.1), 2 * PER_WORKER,
                        loss_scaling=True, steps_per_call=1)
    iterator = iter(eng.distribute(dataset_fn))
    for call in range(5):  # the weights as initialised, then after each step
        if call:
            list(eng.train_steps(iterator, 1))
        weights = eng.model.get_weights()
        print("STEP " + json.dumps({
            "step": eng.step, "applied": int(eng.optimizer.iterations.numpy()),
            "scale": float(eng.optimizer.dynamic_scale.numpy()),
            "finite": bool(all(np.isfinite(w).all() for w in weights)),
            "weights": float(sum(np.abs(w.astype("float64")).sum() for w in weights))}),
            flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","))
