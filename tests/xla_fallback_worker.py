"""One worker of two (argv: index, hosts, jit "on"|"off"|"plain", the seconds a worker whose
compile failed waits for the other's word): a synchronized batch norm CNN (plain: XLA on, the
batch norm not synchronized, which compiles)
trained 8 steps under MultiWorkerMirroredStrategy by loop.fit, on TensorFlow's GPU path for
an all-reduce inside a compiled function (its device check answered "GPU", collectives AUTO:
test_xla.on_gpu_path's), whose XLA compile fails at the first step on CPUs. Prints what fit
said and WEIGHTS {"sums": ..., "jit": ..., "step": ...} (each variable's checksum, the
model's and the optimizer's, XLA at the end), or ends with fit's error. Used by test_xla."""
import contextlib
import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(index, hosts, jit, wait_s):
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts},
                                          "task": {"type": "worker", "index": index}})
    import keras
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.distribute import collective_all_reduce_strategy

    from tfmulti.data import pipeline
    from tfmulti.training import actions, engine, loop, optim

    collective_all_reduce_strategy._is_gpu_device = lambda device: True
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.AUTO))

    def cnn():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(4, 3),
            keras.layers.BatchNormalization(synchronized=jit != "plain"), keras.layers.ReLU(),
            keras.layers.Flatten(), keras.layers.Dense(10)])

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (512, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, len(images)).astype(np.int32)
    eng = engine.Engine(strategy, cnn, optim.constant(0.1), 32, steps_per_call=2,
                        jit_compile=jit != "off")
    eng.xla_fallback.wait_s = wait_s
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        loop.fit(eng, pipeline.train_input_fn(images, labels, 16, seed=0), {}, 2, 4,
                 [actions.Progress(2, 4)])
    print(said.getvalue())
    weights = [float(np.abs(v.numpy()).astype(np.float64).sum())
               for v in [*eng.model.variables, *eng.optimizer.variables]]
    print("WEIGHTS " + json.dumps({"sums": weights, "jit": eng.jit_compile, "step": eng.step}),
          flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], float(sys.argv[4]))
