"""Where a step's time goes: input wait, compute, all-reduce, each worker's compute and the
straggler line, checked against replicas and workers slowed on purpose."""
import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

from tfmulti.accounting import timing
from tfmulti.data import pipeline
from tfmulti.errors import UserError
from tfmulti.training import actions, engine, loop, optim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DELAY, STEPS = 0.08, 6


def test_the_straggler_is_the_worker_past_the_margin_over_the_others_median():
    assert timing.STRAGGLER_MARGIN == 1.5
    assert timing.straggler([1.0]) is None  # one worker: nobody to compare with
    assert timing.straggler([1.0, 1.16]) is None  # equal workers' noise (stragglers.json)
    worker, ratio = timing.straggler([1.0, 1.6])
    assert worker == 1 and ratio == pytest.approx(1.6)
    # the median of the others: one slow other does not hide the slowest
    worker, ratio = timing.straggler([4.0, 1.0, 1.1, 3.0])
    assert worker == 0 and ratio == pytest.approx(4.0 / 1.1)
    assert timing.straggler([0.0, 0.0]) is None
    assert timing.straggler([1.0, 1.5]) is None and timing.straggler([1.0, 1.5001])


class SlowOnReplica(layers.Layer):
    """Sleeps DELAY s in each forward pass of one replica (None: none)."""

    def __init__(self, replica=None, **kwargs):
        super().__init__(**kwargs)
        self.replica = replica

    def compute_output_shape(self, shape):
        return shape

    def call(self, x):
        if self.replica is None:
            return x
        here = tf.distribute.get_replica_context().replica_id_in_sync_group
        slept = tf.cond(tf.equal(here, self.replica),
                        lambda: tf.reshape(tf.py_function(lambda: time.sleep(DELAY) or 0.0, [],
                                                          tf.float32), []),
                        lambda: tf.constant(0.0))
        return x + 0.0 * slept


def slowed_model(replica):
    def build():
        inputs = keras.Input((28, 28, 1))
        x = layers.Conv2D(4, 3, activation="relu")(SlowOnReplica(replica)(inputs))
        return keras.Model(inputs, layers.Dense(10)(layers.Flatten()(x)))
    return build


def test_a_replica_slowed_on_purpose_is_compute_and_its_wait_is_not_all_reduce(
        two_replicas, tiny_synthetic):
    """Replica 1 sleeps DELAY in each forward pass: the worker's compute (until its last
    replica's gradients are there) grows by about DELAY a step; its all-reduce (from then
    until the sum is back) does not, and stays above 0 (two replicas really sum)."""
    fn = pipeline.train_input_fn(tiny_synthetic.train_features, tiny_synthetic.train_targets,
                                 16, seed=0)
    figures = {}
    for name, replica in (("slowed", 1), ("as_is", None)):
        eng = engine.Engine(two_replicas, slowed_model(replica), optim.constant(0.1), 32,
                            steps_per_call=STEPS)
        iterator = iter(eng.distribute(fn))
        list(eng.train_steps(iterator, STEPS))  # traced; then timed
        spent = timing.Spent()
        list(eng.train_steps(iterator, STEPS, spent=spent))
        figures[name] = (spent.compute, spent.allreduce)
    (slow_compute,), (slow_reduce,) = figures["slowed"]
    (compute,), (reduce,) = figures["as_is"]
    assert 0.9 * STEPS * DELAY < slow_compute - compute < 3 * STEPS * DELAY, figures
    assert 0 < slow_reduce < 0.5 * STEPS * DELAY and 0 < reduce, figures


def ancestors(nodes, name):
    """Every node `name` depends on, through data and control inputs, in one function."""
    seen, todo = set(), [name]
    while todo:
        for source in nodes[todo.pop()].input:
            source = source.lstrip("^").split(":")[0]
            if source in nodes and source not in seen:
                seen.add(source)
                todo.append(source)
    return seen


def test_each_replicas_step_starts_after_the_clock_its_batch_arrived_by(
        two_replicas, tiny_synthetic):
    """The clock read when the batch is there must run before the step's first kernel: read
    beside it, it waits behind the replicas' kernels for an inter-op thread and reads late,
    and the compute time reads as input wait (18-41% of an epoch with 1 x 2 thread pools)."""
    eng = engine.Engine(two_replicas, slowed_model(None), optim.constant(0.1), 32)
    fn = pipeline.train_input_fn(tiny_synthetic.train_features, tiny_synthetic.train_targets,
                                 16, seed=0)
    list(eng.train_steps(iter(eng.distribute(fn)), 2))
    [body] = [f for f in eng.traced_call.graph.as_graph_def().library.function
              if any(n.op == "Conv2D" for n in f.node_def)]
    nodes = {n.name: n for n in body.node_def}
    convs = [n.name for n in body.node_def if n.op == "Conv2D"]
    assert len(convs) == 2  # one forward conv on each replica
    for conv in convs:
        before = ancestors(nodes, conv)
        assert any(nodes[t].op == "Timestamp" and any(
            "GetNext" in nodes[g].op for g in ancestors(nodes, t)) for t in before), conv
    held = [n for n in body.node_def if n.op == "Identity" and any(
        i.startswith("^") and nodes[i[1:]].op == "Timestamp" for i in n.input)]
    assert held
    for n in held:  # each beside the op that made its batch part: no copy through device 0
        maker = nodes[n.input[0].split(":")[0]]
        assert list(n.attr["_class"].list.s) == (list(maker.attr["_class"].list.s) or [
            f"loc:@{maker.name}".encode()]), (n, maker)


def test_an_epochs_record_splits_its_seconds_and_names_no_straggler_on_one_worker(
        two_replicas, tiny_synthetic, capsys):
    eng = engine.Engine(two_replicas, slowed_model(None), optim.constant(0.1), 32)
    fn = pipeline.train_input_fn(tiny_synthetic.train_features, tiny_synthetic.train_targets,
                                 16, seed=0)
    [record] = loop.fit(eng, fn, {}, epochs=1, steps_per_epoch=8,
                        actions=[actions.Progress(1, 8)])
    kinds = ("input_wait", "compute", "allreduce")
    assert all(record[f"{kind}_seconds"] > 0 for kind in kinds), record
    assert sum(record[f"{kind}_share"] for kind in kinds) <= 1.0
    for kind in kinds:
        assert record[f"{kind}_share"] == record[f"{kind}_seconds"] / record["seconds"]
    assert "worker_compute_seconds" not in record and "straggler" not in record
    line = [ln for ln in capsys.readouterr().out.splitlines() if " images/s, " in ln][0]
    assert line.endswith(f", input {record['input_wait_share']:.0%}, compute "
                         f"{record['compute_share']:.0%}, all-reduce "
                         f"{record['allreduce_share']:.0%}, MFU {record['mfu']:.1%}"
                         if "mfu" in record else "%")


def test_on_a_gpu_the_clock_waits_for_the_device_through_a_host_copy():
    """A GPU op has only been queued when its control dependencies are met, so clock_after
    brings one element of each tensor to the host first (no GPU here: the graph is checked
    on CPU, where on_device forces that path, and the clock still follows its tensors)."""
    @tf.function
    def timed(on_device):
        start = timing.clock()
        with tf.control_dependencies([start]):
            slow = tf.py_function(lambda: time.sleep(DELAY) or np.ones(3, "float32"), [],
                                  tf.float32)
        return start, timing.clock_after([slow, tf.zeros([2, 2])], on_device=on_device)

    start, after = timed(True)
    assert float(after - start) >= DELAY
    graph = timed.get_concrete_function(True).graph
    copies = [op for op in graph.get_operations() if op.type == "Sum"]
    assert copies and all(op.device.endswith("CPU:0") for op in copies)
    [clock] = [op for op in graph.get_operations() if op.type == "Timestamp"
               and op.control_inputs]
    assert copies[0] in clock.control_inputs
    plain = timed.get_concrete_function(False).graph
    assert not [op for op in plain.get_operations() if op.type == "Sum"]


def test_a_models_error_when_traced_in_the_training_step_is_one_line(one_replica):
    """A layer that works eagerly (the checks before a run call the model eagerly) and fails
    only in a tf.function: one line with its cause, not Keras's traceback."""
    class ShapeLost(layers.Layer):
        def compute_output_shape(self, shape):
            return shape

        def call(self, x):  # a py_function's result has no static shape in a graph
            return x + 0.0 * tf.py_function(lambda: 0.0, [], tf.float32)

    def build():
        inputs = keras.Input((4, 4, 1))
        return keras.Model(inputs, layers.Dense(10)(layers.Flatten()(ShapeLost()(inputs))))

    eng = engine.Engine(one_replica, build, optim.constant(0.1), 8)
    data = tf.data.Dataset.from_tensors((tf.zeros((8, 4, 4, 1)), tf.zeros((8,), tf.int32)))
    with pytest.raises(UserError, match=r"^the model failed in the training step, traced as a "
                                        r"graph \(tf.function\): as_list\(\) is not defined on "
                                        r"an unknown TensorShape\.$"):
        list(eng.train_steps(iter(eng.distribute(lambda ctx: data.repeat())), 1))


def test_a_models_error_when_traced_in_the_evaluation_step_is_one_line(one_replica):
    """The same for a layer that fails only in the evaluation step (training=False)."""
    class ShapeLostInEvaluation(layers.Layer):
        def compute_output_shape(self, shape):
            return shape

        def call(self, x, training=None):
            if training:
                return x
            return x + 0.0 * tf.py_function(lambda: 0.0, [], tf.float32)

    def build():
        inputs = keras.Input((4, 4, 1))
        hidden = ShapeLostInEvaluation()(inputs)
        return keras.Model(inputs, layers.Dense(10)(layers.Flatten()(hidden)))

    eng = engine.Engine(one_replica, build, optim.constant(0.1), 8)
    data = tf.data.Dataset.from_tensors((tf.zeros((8, 4, 4, 1)), tf.zeros((8,), tf.int32)))
    list(eng.train_steps(iter(eng.distribute(lambda ctx: data.repeat())), 1))  # trains
    weighted = data.map(lambda x, y: (x, y, tf.ones((8,))))
    with pytest.raises(UserError, match=r"^the model failed in the evaluation step, traced as "
                                        r"a graph \(tf.function\): as_list\(\) is not defined "
                                        r"on an unknown TensorShape\.$"):
        eng.evaluate(eng.distribute(lambda ctx: weighted), 1)


SLOW_WORKER = '''
import json
import os
import time

import keras
import tensorflow as tf
from keras import layers

DELAY = {delay}


class SlowOnWorker1(layers.Layer):
    """Sleeps DELAY s in each forward pass of worker 1 (a slower GPU, a throttled host)."""

    def compute_output_shape(self, shape):
        return shape

    def call(self, x):
        task = json.loads(os.environ.get("TF_CONFIG", "{{}}")).get("task", {{}})
        if task.get("index", 0) != 1:
            return x
        slept = tf.py_function(lambda: time.sleep(DELAY) or 0.0, [], tf.float32)
        return x + tf.cast(0.0 * tf.reshape(slept, []), x.dtype)


def cnn(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(8, 3, activation="relu")(SlowOnWorker1()(inputs))
    return keras.Model(inputs, layers.Dense(num_classes)(layers.Flatten()(x)))
'''


@pytest.mark.soak  # 25 s of make test: two real workers
def test_a_worker_slowed_on_purpose_is_named_and_the_other_waits_for_it(tmp_path):
    """Two real workers; worker 1's forward pass sleeps DELAY each step. Its compute time
    holds the sleeps, worker 0's all-reduce time holds its wait for them, and the chief
    names worker 1 in a line after each epoch's."""
    (tmp_path / "slowone.py").write_text(SLOW_WORKER.format(delay=DELAY))
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG",)}
    env.update(PYTHONPATH=str(tmp_path), PYTHONUNBUFFERED="1")
    launched = subprocess.run(
        [sys.executable, "-m", "tfmulti.launch", "--workers=2", "--",
         "--dataset=synthetic", "--synthetic_train_size=1024", "--synthetic_test_size=100",
         "--model=slowone:cnn", "--per_replica_batch_size=32", "--epochs=2",
         f"--model_dir={tmp_path}/run"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    steps = 1024 // 64
    epochs = json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"]
    for record in epochs:
        computed, reduced = record["worker_compute_seconds"], record["worker_allreduce_seconds"]
        # (bounds wide enough for a machine loaded by other tests beside this one)
        assert 0.9 * steps * DELAY < computed[1] - computed[0] < 3 * steps * DELAY, record
        assert 0.5 * steps * DELAY < reduced[0] - reduced[1], record
        assert record["straggler"]["worker"] == 1
        assert record["compute_seconds"] == computed[0]  # the chief's own figures
    named = [line for line in launched.stdout.splitlines()
             if line.startswith("[worker 0]   worker 1 is a straggler: its steps computed ")]
    assert len(named) == 2 and "[worker 1]   worker 1 is a straggler" not in launched.stdout
