"""Model FLOPs utilization's count: the FLOPs of one training example that the engine counts
from its traced step against a count by hand. By hand: the forward pass's convolutions and
dense layers from their shapes (2 x multiply-adds), and a training step as three forward
passes (the gradients with respect to the inputs and to the weights each cost one), less the
first layer's input gradient, which nothing needs."""
import keras
import pytest

from tfmulti.accounting import flops
from tfmulti.data import pipeline
from tfmulti.models import zoo
from tfmulti.training import engine, optim


def forward_by_hand(model):
    """Forward FLOPs per example of the Conv2D and Dense layers, and the first layer's."""
    counts = []
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.Conv2D):
            _, height, width, out = layer.output.shape
            kh, kw = layer.kernel_size
            counts.append(2.0 * height * width * out * kh * kw * layer.input.shape[-1])
        elif isinstance(layer, keras.layers.Dense):
            counts.append(2.0 * layer.input.shape[-1] * layer.units)
    return sum(counts), counts[0]


@pytest.mark.parametrize("name, width, strategy, kwargs", [
    ("lenet", 20, "two_replicas", {}),
    ("lenet", 20, "two_replicas", {"jit_compile": True}),
    ("resnet18", 64, "one_replica", {})])
def test_the_counted_flops_are_the_count_by_hand(request, tiny_synthetic, name, width,
                                                  strategy, kwargs):
    strategy = request.getfixturevalue(strategy)
    eng = engine.Engine(strategy, lambda: zoo.build(name, width, seed=0), optim.constant(0.01),
                        8, steps_per_call=1, **kwargs)
    per_replica = 8 // strategy.num_replicas_in_sync
    fn = pipeline.train_input_fn(tiny_synthetic.train_features, tiny_synthetic.train_targets,
                                 per_replica, seed=0)
    list(eng.train_steps(iter(eng.distribute(fn)), 1))
    forward, first = forward_by_hand(eng.model)
    counted = flops.step_cost(eng).per_example
    assert counted == pytest.approx(3 * forward - first, rel=1e-9)
    if name == "resnet18":  # the book's ResNet-18 on 28x28 images: 2.7 GFLOP a training image
        assert counted == pytest.approx(2.72e9, rel=0.01)
    assert flops.utilization(counted, 100.0, 1e12) == pytest.approx(counted * 100 / 1e12)
    assert flops.step_cost(eng) is flops.step_cost(eng)  # counted once


def test_micro_batches_of_unknown_size_are_not_counted_rather_than_miscounted(one_replica,
                                                                              tiny_synthetic):
    """--grad_accum_steps slices each micro-batch at a size the graph does not know: the
    count is 0 and no utilization is reported, rather than a wrong one."""
    eng = engine.Engine(one_replica, lambda: zoo.build("lenet", 20, seed=0),
                        optim.constant(0.01), 8, steps_per_call=1, grad_accum_steps=2)
    fn = pipeline.train_input_fn(tiny_synthetic.train_features, tiny_synthetic.train_targets,
                                 8, seed=0)
    list(eng.train_steps(iter(eng.distribute(fn)), 1))
    counted = flops.step_cost(eng).per_example
    assert counted == 0 and flops.utilization(counted, 100.0, 1e12) is None


def conv_heavy():
    """Nearly all of its FLOPs in two 3x3 convolutions of 32 channels: a step that runs at
    about its kernels' rate (oneDNN's convolution outpaced a 1024x1024 matmul 1.4x on a
    2-core AVX-512 CPU: a matmul's rate as the peak put such a step's MFU past 100%)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, padding="same"),
        keras.layers.Conv2D(32, 3, padding="same"), keras.layers.Conv2D(32, 3, padding="same"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])


def test_no_step_runs_past_the_peak_its_mfu_divides_by(one_replica, tiny_synthetic):
    """The peak is the fastest of the step's own counted kernels, each timed alone (or a
    matmul's rate, where faster): the step's rate, a weighted mean of its kernels', stays
    under it, so its MFU stays at or under 100%. Timed on a step whose FLOPs are nearly all
    in its convolutions (on a 2-core AVX-512 CPU: 69-70% of its kernels' 202 GFLOP/s; over a
    1024x1024 matmul's 100 GFLOP/s, the peak before, it was 141%)."""
    import time

    eng = engine.Engine(one_replica, conv_heavy, optim.constant(0.001), 16, steps_per_call=4)
    fn = pipeline.train_input_fn(tiny_synthetic.train_features, tiny_synthetic.train_targets,
                                 16, seed=0)
    iterator = iter(eng.distribute(fn))
    list(eng.train_steps(iterator, 4))  # traced, counted
    peak = flops.Peak(one_replica, "float32")
    matmul = peak.flops
    kinds = {k.op_type for k in flops.step_cost(eng).kernels}
    assert {"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "MatMul"} <= kinds
    assert sum(k.flops for k in flops.step_cost(eng).kernels) > 0
    bound = peak.of_step(flops.step_cost(eng).kernels)
    assert bound >= matmul and peak.source in kinds | {"matmul"}
    assert peak.of_step(flops.step_cost(eng).kernels) == bound  # measured once
    found = []
    for _ in range(3):  # 3 calls of 4 steps, each beside a peak measured again just after it:
        start = time.perf_counter()  # the suite's other workers load the cores unevenly,
        list(eng.train_steps(iterator, 4))  # and a peak timed in a busier moment than the
        eng.train_results()  # step it divides put one call at 101% (77 GFLOP/s against 146)
        speed = 4 * 16 / (time.perf_counter() - start)
        flops.KERNEL_RATES.clear()
        flops.PEAKS.clear()
        beside = flops.Peak(one_replica, "float32").of_step(flops.step_cost(eng).kernels)
        found.append((flops.utilization(flops.step_cost(eng).per_example, speed, beside),
                      speed, beside))
    mfus = sorted(mfu for mfu, _, _ in found)
    assert 0 < mfus[0] and mfus[1] <= 1, (found, peak.source, matmul)
