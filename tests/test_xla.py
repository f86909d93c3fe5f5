"""--jit_compile: each replica's forward and backward pass compiled with XLA under every
strategy. A step with XLA is the step without it within float tolerance, on 1 and 2 replicas
and 2 workers, in each dtype, for the built-in models and a user's, with micro-batches and
16-bit gradient sums; float16 loss scaling still skips an overflowing step on every replica;
a model XLA cannot compile trains without it after one line naming the op."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from seeds import seed_keras
from test_engine import batches_overflowing_on, float16_linear, replica_copies
from test_resume_yours import USER_CODE

from tfmulti.data import pipeline
from tfmulti.models import zoo
from tfmulti.training import engine, optim

# How far one step's update (new weights less the start) may be from the step without XLA,
# relative to its size. float32: no more than ROUNDING times what a change of the starting
# weights in their last bit makes of the step (XLA only rounds otherwise; a ResNet-18 step
# from the book's small start on one replica moves 1.4e-3 for such a change, and XLA's
# distance measured the same; on 2 replicas 8e-7 and 2e-6). In 16 bits, XLA's step and the
# step without it each err from the float32 step by the precision's own error, within
# SIXTEEN_BITS of each other. They round in different places, so they need not be closer to
# each other than to float32: LeNet's bfloat16 step with oneDNN's kernels (the CPUs with
# AVX-512 VNNI, where TensorFlow turns them on) is 0.0049 from float32 and XLA's 0.0002 from
# it; with Eigen's (the CPUs without) 0.0039, XLA's 0.0049 from float32 and 0.0085 from it.
# Eigen's bfloat16 bias gradient also sums a whole batch in 16 bits: the user's CNN's step
# without XLA is then 0.67 from float32 (its second bias 0.59 off), XLA's 0.0068.
ROUNDING = 10
SIXTEEN_BITS = 2
FLOOR = 1e-5  # ... and never asked below about 100 units of float32's last bit


# A model as a user writes one (functional, batch norm, an L2 penalty, Keras's own
# initializers: the test seeds Keras before building it, as a user's script would)
CNN = """
import keras


def cnn(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(8, 3, padding="same",
                            kernel_regularizer=keras.regularizers.L2(1e-3))(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.MaxPooling2D()(keras.layers.Conv2D(16, 3, activation="relu")(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
"""


@pytest.fixture(scope="module", autouse=True)
def users_cnn(tmp_path_factory):
    import sys

    folder = tmp_path_factory.mktemp("yours")
    (folder / "users_cnn.py").write_text(CNN)
    (folder / "users_sync.py").write_text(SYNC_CNN)
    sys.path.insert(0, str(folder))
    yield "users_cnn:cnn"
    sys.path.remove(str(folder))


def build(model, dtype):
    if ":" in model:  # yours: the same weights at every build, as with the built-ins' seed
        seed_keras(0)
    return zoo.build(model, 4, seed=0, dtype=dtype, init="book")


def engine_for(strategy, jit, dtype="float32", model="resnet18", **kwargs):
    eng = engine.Engine(strategy, lambda: build(model, dtype),
                        optim.constant(0.1), 32, loss_scaling=dtype == "mixed_float16",
                        jit_compile=jit, **kwargs)
    return eng


def steps(eng, dataset, per_replica, n=1):
    fn = pipeline.train_input_fn(dataset.train_features, dataset.train_targets, per_replica,
                                 seed=0)
    losses = []
    for _ in eng.train_steps(iter(eng.distribute(fn)), n):
        losses.append(float(eng.figures.loss.result()))
    return losses, eng.model.get_weights()


def first_batch(eng, dataset, per_replica):
    fn = pipeline.train_input_fn(dataset.train_features, dataset.train_targets, per_replica,
                                 seed=0)
    return next(iter(fn(tf.distribute.InputContext())))


def update(start, weights):
    return np.concatenate([(w - s).ravel() for s, w in zip(start, weights)])


def distance(a, b):
    """|a - b| relative to |b|."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def last_bit(strategy, start, without, dataset, per_replica, **kwargs):
    """How far the float32 step without XLA moves when each starting weight changes in its
    last bit (one unit of float32's 24 bits, up or down at random), relative to its size."""
    signs = np.random.default_rng(0)
    bumped = [w * (1 + np.float32(2.0 ** -23) * signs.choice([-1, 1], w.shape)).astype(w.dtype)
              for w in start]
    eng = engine_for(strategy, False, **kwargs)
    eng.model.set_weights(bumped)
    return distance(update(bumped, steps(eng, dataset, per_replica)[1]), without)


# make test: LeNet (no batch norm; its float32 step in make soak) and a user's CNN (batch
# norm, an L2 penalty); make soak: ResNet-18 (batch norm) in every strategy and dtype (each
# costs 7-25 s, most of it XLA compiling it)
@pytest.mark.parametrize("model, strategy, dtype", [
    pytest.param("lenet", "two_replicas", "float32", marks=pytest.mark.soak),  # as the CNN's
    ("lenet", "two_replicas", "mixed_bfloat16"),
    *(pytest.param(*case, marks=pytest.mark.soak) for case in (  # make test's time on the
        ("lenet", "one_replica", "float32"), ("users_cnn:cnn", "two_replicas", "float32"))),
    ("users_cnn:cnn", "one_replica", "mixed_bfloat16"),
    *(pytest.param("resnet18", strategy, dtype, marks=pytest.mark.soak)
      for strategy in ("one_replica", "two_replicas")
      for dtype in ("float32", "mixed_bfloat16", "mixed_float16"))])
def test_a_step_with_xla_is_the_step_without(request, tiny_synthetic, model, strategy, dtype):
    strategy = request.getfixturevalue(strategy)
    per_replica = 32 // strategy.num_replicas_in_sync
    start = engine_for(strategy, False, model=model).model.get_weights()
    compiled = engine_for(strategy, True, dtype, model=model)
    assert compiled.xla_refusal(*first_batch(compiled, tiny_synthetic, per_replica)) == ""
    loss_xla, with_xla = steps(compiled, tiny_synthetic, per_replica)
    loss_plain, without = steps(engine_for(strategy, False, dtype, model=model), tiny_synthetic,
                                per_replica)
    with_xla, without = update(start, with_xla), update(start, without)
    assert np.linalg.norm(without) > 0
    if dtype == "float32":
        assert distance(with_xla, without) < max(FLOOR, ROUNDING * last_bit(
            strategy, start, without, tiny_synthetic, per_replica, model=model))
        assert loss_xla == pytest.approx(loss_plain, rel=1e-5)
        return
    _, exact = steps(engine_for(strategy, False, model=model), tiny_synthetic, per_replica)
    exact = update(start, exact)
    # XLA's 16-bit step errs from the float32 step no more than the step without XLA does
    # (within SIXTEEN_BITS), and it really ran in 16 bits: a float32 step is 1e-6 away
    assert 10 * FLOOR < distance(with_xla, exact) < SIXTEEN_BITS * distance(without, exact)
    assert loss_xla == pytest.approx(loss_plain, rel=1e-2)


# make test: LeNet's 16-bit sums on 2 replicas and its micro-batches on 1; make soak: its
# micro-batches on 2 replicas, and ResNet-18
@pytest.mark.parametrize("model, kwargs, strategy", [
    *(pytest.param(model, kwargs, "two_replicas",
                   marks=[pytest.mark.soak] if model == "resnet18" or "grad_accum_steps" in kwargs
                   else [])
      for model in ("lenet", "resnet18")
      for kwargs in ({"grad_accum_steps": 2}, {"allreduce_dtype": "bfloat16"})),
    ("lenet", {"grad_accum_steps": 2}, "one_replica")])
def test_xla_with_micro_batches_and_16_bit_sums(request, tiny_synthetic, kwargs, model,
                                                strategy):
    strategy = request.getfixturevalue(strategy)
    per_replica = 32 // strategy.num_replicas_in_sync
    start = engine_for(strategy, False, model=model).model.get_weights()
    _, without = steps(engine_for(strategy, False, model=model, **kwargs), tiny_synthetic,
                       per_replica)
    _, with_xla = steps(engine_for(strategy, True, model=model, **kwargs), tiny_synthetic,
                        per_replica)
    _, exact = steps(engine_for(strategy, False, model=model), tiny_synthetic, per_replica)
    with_xla, without, exact = (update(start, w) for w in (with_xla, without, exact))
    assert distance(without, exact) > 0 or "grad_accum_steps" in kwargs  # bfloat16 rounds
    # micro-batches: float32 rounding (last_bit); 16-bit sums: within their own rounding
    bound = (max(FLOOR, ROUNDING * last_bit(strategy, start, without, tiny_synthetic,
                                            per_replica, model=model, **kwargs))
             if "grad_accum_steps" in kwargs else distance(without, exact))
    assert distance(with_xla, without) < bound


def copies_of(variable):
    """Each replica's copy of `variable` (one with one replica)."""
    return replica_copies(variable) if hasattr(variable.value, "values") else [variable.numpy()]


@pytest.mark.parametrize("strategy, replica", [
    pytest.param("two_replicas", 0, marks=pytest.mark.soak), ("two_replicas", 1),
    ("one_replica", 0)])
def test_float16_loss_scaling_with_xla_skips_an_overflow_on_every_replica(request, strategy,
                                                                          replica):
    strategy = request.getfixturevalue(strategy)
    eng = engine.Engine(strategy, float16_linear, optim.constant(0.1),
                        8 * strategy.num_replicas_in_sync, loss_scaling=True,
                        steps_per_call=1, jit_compile=True)
    iterator = iter(eng.distribute(batches_overflowing_on(replica)))
    start = [copies_of(v) for v in eng.model.trainable_variables]
    list(eng.train_steps(iterator, 1))
    for copies, before in zip(map(copies_of, eng.model.trainable_variables), start):
        for copy, was in zip(copies, before):
            np.testing.assert_array_equal(copy, was)  # skipped, on both replicas
    assert float(eng.optimizer.dynamic_scale.numpy()) == 2.0 ** 14
    list(eng.train_steps(iterator, 1))  # an ordinary batch: applied
    assert eng.step == 2 and int(eng.optimizer.iterations.numpy()) == 1


class HostCall(keras.layers.Layer):
    """A layer that calls back into Python: XLA has no kernel for it."""

    def call(self, x):
        same = tf.numpy_function(lambda a: a, [x], x.dtype, stateful=False)
        return tf.ensure_shape(same, x.shape)


def host_call_model():
    return keras.Sequential([keras.Input((28, 28, 1)), HostCall(), keras.layers.Flatten(),
                             keras.layers.Dense(10)])


def test_a_model_xla_cannot_compile_is_refused_naming_the_op(two_replicas, tiny_synthetic):
    eng = engine.Engine(two_replicas, host_call_model, optim.constant(0.1), 32, jit_compile=True)
    said = eng.xla_refusal(*first_batch(eng, tiny_synthetic, 16))
    assert said.startswith("XLA has no kernel for PyFuncStateless (the op ")
    assert "host_call" in said and "\n" not in said
    eng.use_xla(False)  # and without XLA it trains
    losses, _ = steps(eng, tiny_synthetic, 16, n=1)
    assert np.isfinite(losses[-1])


def test_synchronized_batch_norm_on_cpus_is_refused_in_one_line(two_replicas, tiny_synthetic):
    eng = engine.Engine(two_replicas, lambda: zoo.build("resnet18", 4, seed=0,
                                                        sync_batchnorm=True),
                        optim.constant(0.1), 32, jit_compile=True)
    said = eng.xla_refusal(*first_batch(eng, tiny_synthetic, 16))
    assert "synchronized batch norm" in said and "GPU" in said


KEY_BASES = iter(range(100_000, 10**9, 100_000))


def on_gpu_path(monkeypatch, devices):
    """A MirroredStrategy on logical CPUs that takes TensorFlow's GPU path for an all-reduce
    inside a compiled function: its `_use_merge_call` is false in an XLA context when every
    device is a GPU (the only thing the patch answers), and its collectives are AUTO, as it
    makes them for real GPUs (RING, which XLA does not compile, is for CPUs and logical GPUs:
    mirrored_strategy._make_collective_ops_with_fallbacks). Its collective keys are its own
    (as TensorFlow's tests make them): the suite's other strategies in this process use the
    same devices."""
    from tensorflow.python.distribute import collective_util, mirrored_strategy

    monkeypatch.setattr(mirrored_strategy, "_is_gpu_device", lambda device: True)
    monkeypatch.setattr(tf.distribute.MirroredStrategy, "_collective_key_base", next(KEY_BASES))
    strategy = tf.distribute.MirroredStrategy(devices)
    auto = collective_util.Options(
        implementation=collective_util.CommunicationImplementation.AUTO)
    strategy.extended._communication_options = auto
    for launcher in strategy.extended._collective_ops._launchers:
        launcher._options = auto
    return strategy


@pytest.fixture
def gpu_path(monkeypatch):
    """Two replicas on TensorFlow's GPU path (on_gpu_path)."""
    return on_gpu_path(monkeypatch, ["/cpu:0", "/cpu:1"])


def all_reduces(strategy, eng, features, targets):
    """Each replica's all-reduce instructions in XLA's HLO of its compiled pass."""
    lowered = []
    strategy.run(lambda f, t: lowered.append(
        eng.replica.forward_backward.experimental_get_compiler_ir(f, t)(stage="hlo")),
                 args=(features, targets))
    return [[line for line in hlo.splitlines() if " all-reduce(" in line] for hlo in lowered]


# make test: a user's CNN with one synchronized batch norm; make soak: ResNet-18 (XLA compiles
# its 20 batch norms for 8 s)
@pytest.mark.parametrize("model", ["users_sync:cnn",
                                   pytest.param("resnet18", marks=pytest.mark.soak)])
def test_on_gpus_synchronized_batch_norm_is_xlas_own_all_reduce(gpu_path, users_cnn,
                                                               tiny_synthetic, model):
    """What a GPU does with --sync_batchnorm and XLA, as far as a CPU goes: every batch norm's
    statistics (sum, sum of squares, count) are all-reduced by XLA's all-reduce over both
    replicas inside the compiled pass; a batch norm that is not synchronized leaves the
    compiled pass without any (the gradients are summed outside XLA)."""
    batch = first_batch(None, tiny_synthetic, 16)
    build = (sync_cnn if model == "users_sync:cnn"
             else lambda: zoo.build("resnet18", 4, seed=0, sync_batchnorm=True))
    eng = engine.Engine(gpu_path, build, optim.constant(0.1), 32, jit_compile=True)
    assert eng.xla_refusal(*batch) == ""
    norms = [layer for layer in eng.model._flatten_layers()
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) >= (17 if model == "resnet18" else 1)
    assert all(layer.synchronized for layer in norms)
    for lines in all_reduces(gpu_path, eng, *batch):
        assert len(lines) >= 3 * len(norms)
        assert all("replica_groups={{0,1}}" in line for line in lines)
        assert all('op_type="CollectiveReduceV2"' in line for line in lines)
    plain = engine_for(gpu_path, True, model="users_cnn:cnn")  # its batch norm, its own
    assert all_reduces(gpu_path, plain, *batch) == [[], []]


SYNC_CNN = """
import keras


def cnn(input_shape=(28, 28, 1), num_classes=10):
    return keras.Sequential([
        keras.Input(input_shape), keras.layers.Conv2D(4, 3),
        keras.layers.BatchNormalization(synchronized=True), keras.layers.ReLU(),
        keras.layers.Flatten(), keras.layers.Dropout(0.25), keras.layers.Dense(num_classes)])
"""


def sync_cnn():
    """The user's model, the same weights at every build."""
    import users_sync

    seed_keras(0)
    return users_sync.cnn()


def fitted(eng, dataset, steps_to, steps_per_epoch=4):
    """(every variable of the model and the optimizer, each epoch's training figures) after
    loop.fit trains `eng` from its step to steps_to, and what it said."""
    import contextlib
    import io

    from tfmulti.training import actions, loop

    said = io.StringIO()
    epochs = steps_to // steps_per_epoch + bool(steps_to % steps_per_epoch)
    with contextlib.redirect_stdout(said):
        history = loop.fit(eng, pipeline.train_input_fn(
            dataset.train_features, dataset.train_targets, 16, seed=0, start_step=eng.step),
            {}, epochs, steps_per_epoch, [actions.Progress(epochs, steps_per_epoch)])
    figures = [(r["loss"], r["train_acc"]) for r in history]
    return [v.numpy() for v in [*eng.model.variables, *eng.optimizer.variables]], figures, \
        said.getvalue()


def test_an_input_error_reported_at_a_node_of_the_compiled_pass_is_not_a_compile_failure():
    """With 2 replicas TensorFlow reported the input's error (the real test above) at a node
    of the compiled pass once (make test on a fresh clone): it was taken for XLA failing to
    compile, and the run fell back. tf.data's errors name their iterator: raised as they
    are. The compiled pass's own failures (CAUSES) still fall back."""
    from tfmulti.training.xla import COMPILED_PASS, compiled_pass_failed

    reported_inside = (
        f"Graph execution error:\n\nDetected at node while/{COMPILED_PASS}/IteratorGetNext "
        "defined at (most recent call last):\n<stack traces unavailable>\nError in "
        "user-defined function passed to MapDataset:985 transformation with iterator: "
        "Iterator::Root::Prefetch::Map: ValueError: a spoiled example")
    assert not compiled_pass_failed(tf.errors.InvalidArgumentError(None, None, reported_inside))
    collectives = CAUSES[0][0]
    assert compiled_pass_failed(tf.errors.UnimplementedError(None, None, collectives))


# A real XLA compile failing at the first step, inside the engine's step loop (the collectives of
# TensorFlow's GPU path on CPUs): TensorFlow 2.21 then left a variable holding a freed buffer in
# some runs, and putting it back corrupted the heap (a double free, found under glibc's malloc
# checks: test_falling_back_frees_no_buffer_twice_under_glibcs_malloc_checks), which killed the
# pytest worker of `make test`. The fallback now keeps those buffers; these tests still run in
# `make soak`, each in a process of its own (testing/soak.py, check `isolated`).
@pytest.mark.soak
@pytest.mark.isolated
def test_xlas_compile_failing_at_the_first_step_trains_without_it_losing_nothing(
        gpu_path, tiny_synthetic, tmp_path):
    """A failure in XLA's backend compile, past the lowering checked before a run: XLA has no
    collectives on CPUs, which the compile of a synchronized batch norm on TensorFlow's GPU
    path meets at the first step. The run says so in one line and trains without XLA, from
    its start and from a step resumed mid-epoch: the weights (and the optimizer's state) of
    a run without XLA, bit for bit, and the same epoch figures. The model is a user's
    (Sequential, Keras's initializers, a Dropout layer: after the fallback it draws the masks
    of a run without XLA)."""
    def make(jit):
        return engine.Engine(gpu_path, sync_cnn, optim.constant(0.1), 32, jit_compile=jit)

    without, plain, _ = fitted(make(False), tiny_synthetic, 8)
    first = make(True)
    assert first.xla_refusal(*first_batch(None, tiny_synthetic, 16)) == ""  # it lowers
    _, figures, said = fitted(first, tiny_synthetic, 4)
    assert figures == plain[:1]  # the epoch's figures: nothing of the failed call in them
    fallbacks = [line for line in said.splitlines() if line.startswith("XLA")]
    assert len(fallbacks) == 1 and fallbacks[0].startswith(
        "XLA: off, training without it: XLA failed to compile the first step: Collectives are "
        "not yet implemented for CPU devices when compiling with XLA")
    assert not first.jit_compile and first.step == 4
    for _ in first.train_steps(iter(first.distribute(pipeline.train_input_fn(
            tiny_synthetic.train_features, tiny_synthetic.train_targets, 16, seed=0,
            start_step=4))), 2):
        pass
    path = first.checkpoint_manager(str(tmp_path)).save(checkpoint_number=6)
    resumed = make(True)
    resumed.restore(path)
    weights, _, said = fitted(resumed, tiny_synthetic, 8)  # from step 7 of 8
    assert said.count("XLA: off, training without it") == 1 and "resumed at step 3" in said
    assert resumed.step == 8 and len(weights) == len(without)  # the optimizer's among them
    assert all(np.array_equal(a, b) for a, b in zip(weights, without))


def test_an_error_in_the_first_xla_step_that_is_not_the_compile_is_raised_as_it_is(
        two_replicas, tiny_synthetic):
    """Only the compiled pass's own failure falls back: the input's error at the first step
    with XLA on is raised as it is, and XLA stays on."""
    def fail(x):
        raise ValueError("a spoiled example")

    def broken(context):
        batches = pipeline.train_input_fn(tiny_synthetic.train_features,
                                          tiny_synthetic.train_targets, 16, seed=0)(context)
        return batches.map(lambda x, y: (
            tf.ensure_shape(tf.py_function(fail, [x], x.dtype), x.shape), y))

    eng = engine_for(two_replicas, True, model="lenet")
    with pytest.raises(tf.errors.OpError, match="a spoiled example"):
        list(eng.train_steps(iter(eng.distribute(broken)), 1))
    assert eng.jit_compile


CAUSES = [
    ("Graph execution error:\n\nDetected at node while/xla_pass/StatefulPartitionedCall "
     "defined at (most recent call last):\n  File \"/x/train.py\", line 9, in <module>\n"
     "    main()\n\n  File \"/x/engine.py\", line 140, in _replica_gradients\n"
     "    grads = self._forward_backward(features, targets)\n\nCollectives are not yet "
     "implemented for CPU devices when compiling with XLA.\n\t [[{{node while/xla_pass/"
     "StatefulPartitionedCall}}]] [Op:__inference__train_steps_fn_1]",
     "Collectives are not yet implemented for CPU devices when compiling with XLA."),
    ("Graph execution error:\n\nDetected at node x defined at (most recent call last):\n"
     "<stack traces unavailable>\n2 root error(s) found.\n  (0) INTERNAL:  ptxas exited "
     "with non-zero error code\n\n  (1) INTERNAL: the same\n0 successful operations.",
     "ptxas exited with non-zero error code")]


@pytest.mark.parametrize("message, cause", CAUSES)
def test_a_runtime_errors_cause_is_its_line_not_its_stacks(message, cause):
    from tfmulti.training import xla

    assert xla.runtime_cause(message) == cause


# A real XLA compile failing at the first step, inside the engine's step loop (the collectives of
# TensorFlow's GPU path on CPUs): TensorFlow 2.21 then left a variable holding a freed buffer in
# some runs, and putting it back corrupted the heap (a double free, found under glibc's malloc
# checks: test_falling_back_frees_no_buffer_twice_under_glibcs_malloc_checks), which killed the
# pytest worker of `make test`. The fallback now keeps those buffers; these tests still run in
# `make soak`, each in a process of its own (testing/soak.py, check `isolated`).
@pytest.mark.soak
@pytest.mark.isolated
def test_a_run_whose_first_step_xla_fails_to_compile_says_so_and_records_it(
        gpu_path, tiny_synthetic, tmp_path, capsys):
    """The whole run (train_and_evaluate): its XLA line before the first step, the fallback's
    line at it, and metrics.json's `xla` false."""
    import json

    from tfmulti.run.config import RunConfig
    from tfmulti.training import train

    cfg = RunConfig(model="users_sync:cnn", dataset="synthetic", global_batch_size=32,
                    epochs=1, jit_compile="on", checkpoint_steps=0)
    train.train_and_evaluate(gpu_path, tiny_synthetic, cfg, model_dir=str(tmp_path),
                             write_model=False)  # metrics.json is all it reads
    said = capsys.readouterr().out.splitlines()
    assert XLA_LINE + " (--jit_compile=on)" in said
    fell = [line for line in said if line.startswith("XLA: off, training without it: XLA failed")]
    assert len(fell) == 1 and said.index(fell[0]) > said.index(XLA_LINE + " (--jit_compile=on)")
    assert json.loads((tmp_path / "metrics.json").read_text())["xla"] is False


# A real XLA compile failing at the first step, inside the engine's step loop (the collectives of
# TensorFlow's GPU path on CPUs): TensorFlow 2.21 then left a variable holding a freed buffer in
# some runs, and putting it back corrupted the heap (a double free, found under glibc's malloc
# checks: test_falling_back_frees_no_buffer_twice_under_glibcs_malloc_checks), which killed the
# pytest worker of `make test`. The fallback now keeps those buffers; these tests still run in
# `make soak`, each in a process of its own (testing/soak.py, check `isolated`).
@pytest.mark.soak
@pytest.mark.isolated
def test_the_doctors_step_of_your_model_falls_back_as_the_run_does(gpu_path):
    """The doctor's check of your model trains one step with your flags: XLA failing to
    compile it is the run's warning line, and the check goes on without XLA."""
    from tfmulti.doctor import yourcode
    from tfmulti.run.config import RunConfig

    cfg = RunConfig(model="users_sync:cnn", dataset="synthetic", synthetic_train_size=256,
                    synthetic_test_size=64, jit_compile="on")
    found = list(yourcode.findings_of(cfg, gpu_path))
    assert not [f for f in found if f[0] == "problem"], found
    [warned] = [text for kind, label, text in found if label == "xla"]
    assert warned.startswith("XLA: off, training without it: XLA failed to compile the first ")


def two_workers_of(*jits, wait_s=300, env=None):
    """(exit code, stdout, stderr) of each worker of tests/xla_fallback_worker.py, worker i
    with --jit_compile jits[i] (plain: on, a batch norm that compiles), env added to their
    environment; killed after 300 s."""
    import os
    import subprocess
    import sys

    from test_multiworker import ROOT, environment

    from tfmulti.processes import launcher

    hosts = ",".join(f"localhost:{p}" for p in launcher.free_ports(2))
    workers = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests",
                                                              "xla_fallback_worker.py"),
                                 str(i), hosts, jit, str(wait_s)], cwd=ROOT,
                                env={**environment(), **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
               for i, jit in enumerate(jits)]
    ended = []
    for p in workers:
        try:
            ended.append((p.wait(timeout=300), *p.communicate()))
        except subprocess.TimeoutExpired:
            for q in workers:
                q.kill()
            raise AssertionError("a worker was still running after 300 s") from None
    return ended


def weights_of(out):
    import json

    return json.loads(out.split("WEIGHTS ", 1)[1])


@pytest.mark.soak  # 4 worker processes, about a minute
def test_two_workers_whose_first_step_xla_fails_to_compile_fall_back_together():
    """The first step's compile failing on both workers (the collective of a synchronized
    batch norm on TensorFlow's GPU path, which XLA cannot compile on CPUs): each says so to
    the other, both say it once and train on without XLA, to the weights (and the
    optimizer's state) of two workers without XLA, bit for bit, with the same epoch
    figures."""
    import re

    without = two_workers_of("off", "off")
    fell = two_workers_of("on", "on")
    assert [code for code, _, _ in without + fell] == [0, 0, 0, 0], fell[0][2][-3000:]
    figures = re.compile(r"loss: [\d.]+ - accuracy: [\d.]+")  # each epoch's
    for (_, said, _), (_, plain_said, _) in zip(fell, without):
        assert said.count("XLA: off, training without it: XLA failed to compile the first "
                          "step: ") == 1
        assert weights_of(said) == {**weights_of(plain_said), "jit": False}
        assert weights_of(said)["step"] == 8
        assert figures.findall(said) == figures.findall(plain_said) != []


@pytest.mark.soak  # 20 worker processes, about 5 minutes
def test_falling_back_frees_no_buffer_twice_under_glibcs_malloc_checks():
    """After a failed first compile, TensorFlow 2.21 can leave a variable (a synchronized batch
    norm's moving mean) holding a buffer already freed; putting the variable back freed it
    again, which aborted about 1 in 6 worker pairs under glibc's malloc checks (a heap
    corrupted silently, or a crash later, without them). The fallback keeps those buffers:
    10 pairs falling back together with the checks on, every worker ending well."""
    import glob

    checks = glob.glob("/usr/lib/*/libc_malloc_debug.so.0")
    assert checks, "glibc's malloc checks (libc_malloc_debug.so.0, glibc 2.34+) not found"
    env = {"LD_PRELOAD": checks[0], "GLIBC_TUNABLES": "glibc.malloc.check=3"}
    for _ in range(10):
        ended = two_workers_of("on", "on", env=env)
        assert [code for code, _, _ in ended] == [0, 0], [err[-2000:] for _, _, err in ended]


@pytest.mark.soak  # 2 worker processes, about half a minute
def test_a_worker_whose_compile_fails_alone_stops_every_worker_in_one_line():
    """Worker 1's compile fails; worker 0 (its batch norm not synchronized) goes on into the
    step and waits there for worker 1: worker 1 waits its bound for worker 0's word, says why
    in one line, reports the error to every worker, and both stop."""
    import time

    start = time.monotonic()
    ended = two_workers_of("plain", "on", wait_s=5)
    assert time.monotonic() - start < 240
    assert [code != 0 for code, _, _ in ended] == [True, True]
    (_, out0, _), (_, out1, err1) = ended
    assert "WEIGHTS" not in out0 + out1
    assert ("XLA failed to compile the first step: Collectives are not yet implemented for "
            "CPU devices") in err1
    assert ("not on every worker within 5 s, and the workers fall back without XLA only "
            "together: run again with --jit_compile=off") in err1


# A real XLA compile failing at the first step, inside the engine's step loop (the collectives of
# TensorFlow's GPU path on CPUs): TensorFlow 2.21 then left a variable holding a freed buffer in
# some runs, and putting it back corrupted the heap (a double free, found under glibc's malloc
# checks: test_falling_back_frees_no_buffer_twice_under_glibcs_malloc_checks), which killed the
# pytest worker of `make test`. The fallback now keeps those buffers; these tests still run in
# `make soak`, each in a process of its own (testing/soak.py, check `isolated`).
@pytest.mark.soak
@pytest.mark.isolated
def test_the_doctors_measurement_of_a_step_xla_fails_to_compile_is_a_refusal(monkeypatch):
    """The doctor and the batch search time a step with XLA (advise.measure_batch): a compile
    that fails at its first step is XLA refused, said, not a traceback."""
    from tfmulti.bench import advise, progress

    one = on_gpu_path(monkeypatch, ["/cpu:0"])  # one replica: the doctor's
    measured = advise.measure_batch((one, "users_sync:cnn", 4, "float32", None), 8, 3,
                                    float("inf"), progress.silent(), jit=True)
    assert measured["refused"].startswith("XLA failed to compile the first step: ")


# The digits of test_resume_yours.py with a CNN XLA compiles (its random augmentation
# layers aside): batch norm and Dropout
XLA_USER_CODE = USER_CODE[:USER_CODE.index("def cnn")] + '''def cnn(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(8, 3, padding="same")(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    x = layers.Dropout(0.25)(layers.Flatten()(x))
    return keras.Model(inputs, layers.Dense(num_classes)(x))
'''


XLA_LINE = "XLA: each replica's forward and backward pass compiled"


@pytest.mark.soak
@pytest.mark.parametrize("replicas", [2, 1])  # 1: the pipeline not tf.distribute's
def test_killed_with_xla_and_run_again_ends_at_the_uninterrupted_xla_weights(tmp_path,
                                                                           replicas):
    """kill -9 mid-epoch of a run with XLA (a user's CNN with batch norm and Dropout, on 1
    and 2 replicas) and the same command again: the weights of the uninterrupted XLA run,
    bit for bit."""
    import subprocess
    import sys

    from test_resume import environment, killed_when_saved, weights

    (tmp_path / "xla_user.py").write_text(XLA_USER_CODE)
    env = {**environment(), "PYTHONPATH": str(tmp_path)}

    def command(model_dir):
        return [sys.executable, "-m", "tfmulti.main", "--model=xla_user:cnn",
                "--dataset=xla_user:digits", f"--cpu_replicas={replicas}", "--global_batch_size=64",
                "--deterministic", "--seed=3", "--checkpoint_steps=8", "--epochs=2",
                "--steps_per_call=1", "--jit_compile=on", f"--model_dir={model_dir}"]

    whole = subprocess.run(command(tmp_path / "whole"), cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    assert XLA_LINE in whole.stdout
    step = killed_when_saved(command(tmp_path / "killed"), env, tmp_path / "killed",
                             lambda s: s % 24 != 0 and s > 24, cwd=tmp_path)
    again = subprocess.run(command(tmp_path / "killed"), cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"at step {step + 1}" in again.stdout and XLA_LINE in again.stdout
    for a, b in zip(weights(tmp_path / "whole"), weights(tmp_path / "killed")):
        np.testing.assert_array_equal(a, b, err_msg=f"killed after step {step}")


@pytest.mark.soak
def test_two_workers_with_xla_end_as_a_two_replica_process_with_xla(tmp_path):
    """MultiWorkerMirroredStrategy: each worker compiles its replica's step with XLA, the
    all-reduce across the workers stays outside it. 2 epochs of ResNet-18 (batch norm) on 2
    workers (the launcher) end within float tolerance of 2 replicas in one process, both with
    XLA; the workers hold the same weights."""
    import json
    import subprocess
    import sys

    from test_multiworker import ROOT, RUN, environment, weights

    run = [*RUN, "--synthetic_train_size=512", "--jit_compile=on"]
    single = subprocess.run([sys.executable, "-m", "tfmulti.main", *run, "--cpu_replicas=2",
                             f"--model_dir={tmp_path}/single"], cwd=ROOT, env=environment(),
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    assert "XLA: each replica's forward and backward pass compiled" in single.stdout
    launched = subprocess.run([sys.executable, "-m", "tfmulti.launch", "--workers=2", "--",
                               *run, f"--model_dir={tmp_path}/workers"], cwd=ROOT,
                              env=environment(), capture_output=True, text=True, timeout=600)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert "[worker 0] XLA: each replica's forward and backward pass compiled" in launched.stdout
    metrics = json.loads((tmp_path / "workers" / "metrics.json").read_text())
    assert metrics["xla"] and len(set(metrics["weights_fingerprints"])) == 1
    for a, b in zip(weights(tmp_path / "single"), weights(tmp_path / "workers")):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def two_workers_update(tmp_path, name, dtype, jit):
    """The weights' change (new less start) after one step of ResNet-18 (batch norm) on 2
    workers (the launcher), as one vector; `name` its run folder. The step of engine_for's
    (the book's start, learning rate 0.1 at a global batch of 32)."""
    import subprocess
    import sys

    from test_multiworker import ROOT, RUN, environment, weights

    from tfmulti.run.config import RunConfig

    flags = [f for f in RUN if not f.startswith(("--synthetic_train_size", "--epochs"))]
    launched = subprocess.run(
        [sys.executable, "-m", "tfmulti.launch", "--workers=2", "--", *flags, "--epochs=1",
         "--synthetic_train_size=32", "--init=book", "--base_lr=0.8", f"--dtype={dtype}",
         f"--jit_compile={jit}",
         f"--model_dir={tmp_path}/{name}"], cwd=ROOT, env=environment(), capture_output=True,
        text=True, timeout=600)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert ("[worker 0] XLA: each replica's forward and backward pass compiled"
            in launched.stdout) == (jit == "on")
    start = zoo.build("resnet18", 4, (28, 28, 1), 10, dtype=dtype, init="book",
                      seed=RunConfig().seed).get_weights()
    return update(start, weights(tmp_path / name))


@pytest.mark.soak  # 6 runs of 2 workers, about 3 minutes
def test_two_workers_step_with_xla_as_without_it_in_each_dtype(tmp_path, two_replicas,
                                                               tiny_synthetic):
    """MultiWorkerMirroredStrategy, a step with XLA and without on 2 workers, in each dtype:
    float32 within rounding of each other (ROUNDING times what a last-bit change of the start
    makes of the same step on 2 replicas); in 16 bits XLA's step as close to the float32
    step as the step without it is (the precision's own error)."""
    exact = two_workers_update(tmp_path, "float32-off", "float32", "off")
    assert np.linalg.norm(exact) > 0
    start = engine_for(two_replicas, False).model.get_weights()
    _, plain = steps(engine_for(two_replicas, False), tiny_synthetic, 16)
    rounding = ROUNDING * last_bit(two_replicas, start, update(start, plain), tiny_synthetic, 16)
    assert distance(two_workers_update(tmp_path, "float32-on", "float32", "on"),
                    exact) < max(FLOOR, rounding)
    for dtype in ("mixed_bfloat16", "mixed_float16"):
        without = two_workers_update(tmp_path, f"{dtype}-off", dtype, "off")
        with_xla = two_workers_update(tmp_path, f"{dtype}-on", dtype, "on")
        assert distance(with_xla, without) < distance(without, exact), dtype
        assert distance(with_xla, exact) < 1.1 * distance(without, exact), dtype


# ----------------------------------------------------------------------------- auto

def test_auto_follows_the_doctors_verdict_for_this_model_and_device(tmp_path, monkeypatch):
    from tfmulti.training import xla

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    on, said = xla.auto("k")
    assert not on and "not measured" in said and "doctor --jit_compile=auto" in said
    xla.record_verdict("faster", {"ratio": 1.31, "refused": "", "step_s": 0.2,
                                  "step_s_xla": 0.153})
    xla.record_verdict("slower", {"ratio": 0.53, "refused": "", "step_s": 0.1,
                                  "step_s_xla": 0.19})
    xla.record_verdict("refused", {"ratio": None, "refused": "XLA has no kernel for X",
                                   "step_s": 0.1, "step_s_xla": None})
    assert xla.auto("faster") == (True, "XLA: on (--jit_compile=auto: the doctor measured one "
                                        "replica's step 1.31x as fast with it on these devices)")
    assert xla.auto("slower")[0] is False and "0.53x as fast" in xla.auto("slower")[1]
    assert xla.auto("refused") == (False, "XLA: off (--jit_compile=auto: XLA has no kernel "
                                          "for X)")
    (tmp_path / "tfmulti" / "xla.json").write_text("{spoiled")  # measured again, not a crash
    assert xla.auto("faster")[0] is False


def test_doctors_writing_their_verdicts_at_once_keep_every_one(tmp_path):
    """Several doctors at once (a launcher's workers): each verdict is kept."""
    import subprocess
    import sys

    code = ("import sys; from tfmulti.training import xla\n"
            "for i in range(20):\n"
            "    xla.record_verdict(f'{sys.argv[1]}-{i}', {'ratio': 1.0, 'refused': '',"
            " 'step_s': 1.0, 'step_s_xla': 1.0})\n")
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path)}
    writers = [subprocess.Popen([sys.executable, "-c", code, str(n)], env=env)
               for n in range(4)]
    assert [w.wait(120) for w in writers] == [0] * 4
    import json

    kept = json.loads((tmp_path / "tfmulti" / "xla.json").read_text())
    assert set(kept) == {f"{n}-{i}" for n in range(4) for i in range(20)}


def test_a_verdict_waits_for_a_held_lock_within_its_bound(tmp_path, monkeypatch):
    """Another process holding the verdicts' lock: the writer gives up after its bound,
    writing nothing, and writes once the lock is free."""
    import subprocess
    import sys
    import time

    from tfmulti.training import xla

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "tfmulti").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(tmp_path / 'tfmulti' / 'xla.json.lock')!r}, 'a')\n"
        "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(30)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        measured = {"ratio": 1.2, "refused": "", "step_s": 1.0, "step_s_xla": 0.8}
        assert xla.record_verdict("k", measured, wait_s=0.5) is False
        assert 0.5 <= time.monotonic() - started < 5
        assert not (tmp_path / "tfmulti" / "xla.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert xla.record_verdict("k", measured, wait_s=0.5) is True
    assert xla.auto("k")[0] is True


@pytest.mark.soak
def test_the_doctor_measures_xla_and_a_run_with_auto_follows_it(tmp_path):
    """python -m tfmulti.doctor --jit_compile=auto times one replica's step with XLA and
    without and keeps the verdict; the main job with the same flags and auto follows it."""
    import json
    import os
    import subprocess
    import sys

    from test_multiworker import ROOT, environment

    env = {**environment(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    flags = ["--cpu_replicas=2", "--dataset=synthetic", "--synthetic_train_size=512",
             "--synthetic_test_size=128", "--model=lenet", "--width=4",
             "--global_batch_size=64", "--jit_compile=auto"]
    doctor = subprocess.run([sys.executable, "-m", "tfmulti.doctor", *flags,
                             "--measure_budget=20", f"--model_dir={tmp_path}/run"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    line = next(x.strip() for x in doctor.stdout.splitlines() if x.strip().startswith("xla:"))
    assert "ms with XLA" in line and "--jit_compile=auto turns it o" in line
    [verdict] = json.loads((tmp_path / "cache" / "tfmulti" / "xla.json").read_text()).values()
    faster = verdict["ratio"] > 1
    assert line.endswith(f"turns it {'on' if faster else 'off'} for this model, batch and "
                         "dtype on these devices (the prediction above is of the step "
                         f"{'with' if faster else 'without'} it)")
    main = subprocess.run([sys.executable, "-m", "tfmulti.main", *flags, "--epochs=1",
                           f"--model_dir={tmp_path}/run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert main.returncode == 0, main.stderr
    assert (f"XLA: {'on' if faster else 'off'} (--jit_compile=auto: the doctor measured one "
            f"replica's step {verdict['ratio']:.2f}x as fast") in main.stdout
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["xla"] is faster
    assert os.listdir(tmp_path / "cache" / "tfmulti")
