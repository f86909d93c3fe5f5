"""One worker of two (argv: index, hosts, allreduce dtype): trains 3 steps under
MultiWorkerMirroredStrategy, traces the engine's train-steps function and prints the collective
all-reduces in it, as JSON {"per_step": n, "per_call": m, "step_dtypes": [...],
"weights": checksum} (inside the steps' loop, and outside it). Used by test_multiworker."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(index, hosts, allreduce_dtype):
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts},
                                          "task": {"type": "worker", "index": index}})
    import numpy as np
    import tensorflow as tf

    from tfmulti.data import pipeline
    from tfmulti.models import zoo
    from tfmulti.training import engine, optim

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (256, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, len(images)).astype(np.int32)
    eng = engine.Engine(strategy, lambda: zoo.build("resnet18", 4, seed=0),
                        optim.constant(0.1), 32, steps_per_call=3,
                        allreduce_dtype=allreduce_dtype)
    iterator = iter(eng.distribute(pipeline.train_input_fn(images, labels, 16, seed=0)))
    for _ in eng.train_steps(iterator, 3):
        pass
    graph = eng._train_steps.get_concrete_function(
        iterator, tf.constant(3, tf.int64), tf.constant(0.0, tf.float64)).graph.as_graph_def()
    outside = sum(n.op.startswith("CollectiveReduce") for n in graph.node)
    loops = [f for f in graph.library.function if f.signature.name.startswith("while_body")]
    inside = [tf.dtypes.as_dtype(n.attr["T"].type).name for f in loops for n in f.node_def
              if n.op.startswith("CollectiveReduce")]
    weights = float(sum(np.abs(w).sum() for w in eng.model.get_weights()))
    print("COLLECTIVES " + json.dumps({"per_step": len(inside), "per_call": outside,
                                       "step_dtypes": inside, "weights": weights}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3])
