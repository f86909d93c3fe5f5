"""Published multi-GPU and multi-machine results, and what stepmodel.py says of them.

Each case is reproduced from what its source states (hardware, model, batch per device) and
one measured figure it gives (the 1-device rate, or a step time); the prediction is then
compared with the figure the source gives for more devices. Where the source is silent, the
assumption is written in the case. Reference data for the step model's tests
(test_predict.py); `python tests/published_cases.py` prints the table. Pure arithmetic.
"""
import dataclasses
import math

from tfmulti.bench import stepmodel


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    source: str
    quantity: str  # what is compared
    published: float
    predicted: float
    assumptions: str
    why: str = ""  # why the prediction misses by more than 25%, when it does

    @property
    def error(self):
        return self.predicted / self.published - 1


# Gradient bytes (float32) and tensor counts: the models' parameter counts as their papers
# and Keras give them; the tensor counts matter only when each tensor is reduced on its own.
RESNET50 = stepmodel.Model(25.6e6 * 4, 161)
RESNET101 = stepmodel.Model(44.5e6 * 4, 314)
INCEPTION_V3 = stepmodel.Model(23.8e6 * 4, 188)
VGG16 = stepmodel.Model(138.4e6 * 4, 32)
ALEXNET = stepmodel.Model(61.1e6 * 4, 16)
BOOK_RESNET18 = stepmodel.Model(44703272, 76)  # tfmulti's resnet18 at width 64: the book's
BOOK_LENET = stepmodel.Model(516272, 8)  # tfmulti's lenet: the book's from-scratch LeNet
FASHION_MNIST_TRAIN = 60000


def _packs(model, bytes_per_pack=64e6):
    """Horovod's Tensor Fusion buffer (64 MB by default) cuts the gradients in this many."""
    return max(1, math.ceil(model.gradient_bytes / bytes_per_pack))


def nvidia_dgx1():
    source = ("NVIDIA DeepLearningExamples, TensorFlow ResNet-50 v1.5 README: DGX-1 8x V100 "
              "16 GB, Horovod over NCCL, XLA")
    cases = []
    for precision, one, eight, batch in (("FP32", 412, 3170, 128), ("AMP", 1270, 9510, 256)):
        setup = stepmodel.Setup(devices=8, intra=stepmodel.link("nvlink2"),
                              packs=_packs(RESNET50))
        rate = stepmodel.predict(stepmodel.Compute(one), RESNET50, setup, batch).images_per_s
        cases.append(Case(
            f"ResNet-50 {precision}, 8 V100 (NVLink 2), batch {batch} per GPU", source,
            "images/s on 8 GPUs", eight, rate,
            f"the 1-GPU {one} images/s; NVLink 2 at 120 GB/s bus bandwidth; float32 "
            "gradients"))
    return cases


def tensorflow_2017_dgx1():
    """The two all-reduce rows of the table (the others used parameter servers on the CPU,
    which this model does not describe). Its "training synthetic data" table: 1 and 8 GPUs
    (VGG16 154 -> 1081; AlexNet 2987 -> 17822). Not the real-data one (VGG16 154 -> 898,
    AlexNet's 8 GPUs left out "due to it maxing out the input pipeline"): these cases give
    the model no input pipeline, so the figures to compare are those without one."""
    source = ("TensorFlow performance benchmarks (tensorflow.org, May 2017, tf_cnn_benchmarks): "
              "DGX-1 8x P100, variable_update=replicated with NCCL, synthetic data")
    cases = []
    for name, model, one, eight, batch in (("VGG16", VGG16, 154, 1081, 64),
                                           ("AlexNet", ALEXNET, 2987, 17822, 512)):
        setup = stepmodel.Setup(devices=8, intra=stepmodel.link("nvlink1"), packed=False)
        rate = stepmodel.predict(stepmodel.Compute(one), model, setup, batch).images_per_s
        why = ""
        if name == "AlexNet":
            why = ("an AlexNet step on a P100 lasts 171 ms of which the model's all-reduce "
                   "is 7 ms; the measured 75% efficiency needs about 60 ms more per step. The "
                   "2017 replicated mode had each of the 8 towers' variable updates and its "
                   "per-tensor NCCL 1 calls driven from one process: host work that grows with "
                   "the device count, which this model (one host thread per device, as "
                   "MirroredStrategy runs) does not have")
        cases.append(Case(
            f"{name}, 8 P100 (NVLink 1), batch {batch} per GPU", source, "images/s on 8 GPUs",
            eight, rate, f"the 1-GPU {one} images/s; NVLink 1 at 64 GB/s; one all-reduce per "
            "variable", why))
    return cases


def horovod():
    source = ("Sergeev and Del Balso, Horovod (arXiv:1802.05799, 2018) and its README: 128 "
              "Pascal GPUs, 32 servers x 4, 25 Gb Ethernet over TCP, 88% efficiency")
    cases = []
    for name, model, one, origin in (
            ("Inception V3", INCEPTION_V3, 142, "a P100's 142 images/s at batch 64 in "
             "TensorFlow's 2017 table"),
            ("ResNet-101", RESNET101, 136, "136 images/s: an extrapolation from ResNet-152 "
             "alone, a P100's 91.8 images/s at batch 64 in TensorFlow's 2017 table scaled by "
             "the multiply-adds, 11.3 / 7.6 GFLOPs (the same scaling of its ResNet-50 rate, "
             "219 x 3.8 / 7.6, would give 110)")):
        setup = stepmodel.Setup(devices=4, machines=32, intra=stepmodel.link("pcie3"),
                              inter=stepmodel.link("eth25"), packs=_packs(model))
        result = stepmodel.predict(stepmodel.Compute(one), model, setup, 64)
        cases.append(Case(
            f"{name}, 128 GPUs on 32 servers, 25 GbE", source, "efficiency at 128 GPUs", 0.88,
            result.efficiency,
            f"batch 64 per GPU (Horovod's benchmark recipe; the paper does not say); {origin}; "
            "PCIe 3 inside a server; 2.8 GB/s bus bandwidth between servers; no overlap"))
    return cases


def goyal():
    source = ("Goyal et al., Accurate, Large Minibatch SGD (arXiv:1706.02677, 2017): 8 P100 "
              "per server on NVLink, 50 Gb Ethernet, recursive halving and doubling")
    compute = stepmodel.Compute(32 / 0.19)  # "over 16 minutes" an epoch on 8 GPUs: 0.19 s/step

    def step(servers):
        setup = stepmodel.Setup(devices=8, machines=servers, intra=stepmodel.link("nvlink1"),
                              inter=stepmodel.link("eth50"), algorithm="tree")
        return stepmodel.predict(compute, RESNET50, setup, 32)

    assumptions = ("ResNet-50, 32 images per GPU; 0.19 s per iteration on 8 GPUs (an epoch in "
                   "over 16 minutes); 5.6 GB/s between servers; no overlap (the paper "
                   "overlaps the all-reduce with backprop)")
    return [
        Case("ResNet-50, 8 to 256 GPUs (32 servers)", source, "efficiency, 256 against 8 GPUs",
             0.90, step(32).images_per_s / step(1).images_per_s / 32, assumptions),
        Case("ResNet-50, 8 to 352 GPUs (44 servers)", source,
             "iteration time, 352 against 8 GPUs", 1.12,
             sum(step(44).terms.values()) / sum(step(1).terms.values()), assumptions),
    ]


def book():
    source = ("Dive into Deep Learning, multi-GPU sections (MXNet; the printed lines of its 2019 "
              "one-day course notebooks for ResNet-18, of the book for LeNet); GPU model "
              "not stated")
    resnet = stepmodel.Compute(FASHION_MNIST_TRAIN / 13.2)  # 13.2 s an epoch on 1 GPU, batch 256
    setup = stepmodel.Setup(devices=2, intra=stepmodel.link("pcie3"), packed=False)
    resnet_two = stepmodel.predict(resnet, BOOK_RESNET18, setup, 256)
    # LeNet: 11.0 s an epoch at batch 256 is 46.8 ms a step (235 steps), for 0.6 GFLOP of
    # work (about 1 ms on any GPU): host time, fixed per step.
    lenet = stepmodel.Compute(math.inf, fixed_s=11.0 / math.ceil(FASHION_MNIST_TRAIN / 256))
    lenet_two = stepmodel.predict(lenet, BOOK_LENET, setup, 128)
    return [
        Case("ResNet-18 (the book's), 1 to 2 GPUs, 256 per GPU", source,
             "seconds an epoch on 2 GPUs", 7.3, FASHION_MNIST_TRAIN / resnet_two.images_per_s,
             "13.2 s an epoch on 1 GPU; PCIe 3 between the GPUs; one all-reduce per tensor"),
        Case("LeNet from scratch, 1 to 2 GPUs, global batch 256", source,
             "seconds an epoch on 2 GPUs", 13.7, FASHION_MNIST_TRAIN / lenet_two.images_per_s,
             "11.0 s an epoch on 1 GPU, all of it host time per step; PCIe 3",
             "the book's loop runs each GPU's forward, backward, gradient copies and update "
             "from one Python thread, one device after the other: host work that doubles "
             "with 2 GPUs, where the model has none per device"),
    ]


def cases():
    return nvidia_dgx1() + tensorflow_2017_dgx1() + horovod() + goyal() + book()


def format_table(rows):
    lines = [f"{'case':<58} {'quantity':<34} {'published':>9} {'predicted':>9} {'error':>7}"]
    for case in rows:
        lines.append(f"{case.name:<58} {case.quantity:<34} {case.published:>9.4g} "
                     f"{case.predicted:>9.4g} {case.error:>+7.1%}")
    return "\n".join(lines)


def main():
    rows = cases()
    print(format_table(rows))
    for number, case in enumerate(rows, 1):
        print(f"\n{number}. {case.name}\n   source: {case.source}\n   from: {case.assumptions}"
              + (f"\n   why it misses: {case.why}" if case.why else ""))


if __name__ == "__main__":
    main()
