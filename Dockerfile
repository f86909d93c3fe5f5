# tfmulti on the official TensorFlow GPU image of the version setup.py pins.
#
#   docker build -t tfmulti .
#   docker run --rm --gpus all --shm-size=1g --ulimit memlock=-1 \
#       -v "$PWD/runs:/work/runs" tfmulti --num_gpus=2
#
# The entrypoint is the main job; other entry points through --entrypoint python:
#   docker run ... --entrypoint python3 tfmulti -m tfmulti.doctor --num_gpus=2
# See the README ("Containers") for data mounts, tuning sessions and multi-worker jobs.
FROM tensorflow/tensorflow:2.21.0-gpu

# Unbuffered logs; no .pyc files in the image; pip quiet and without a cache layer.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_CPP_MIN_LOG_LEVEL=2

# Dependencies first (a layer that changes only with setup.py), TensorFlow from the base image.
WORKDIR /opt/tfmulti
COPY setup.py README.md ./
RUN mkdir tfmulti && touch tfmulti/__init__.py \
    && python3 -m pip install --no-cache-dir . \
    && python3 -m pip uninstall --yes tfmulti \
    && python3 -c "import tensorflow as tf; v = tf.__version__; assert v.startswith('2.21.'), v"

# The package itself: a small layer.
COPY tfmulti ./tfmulti
COPY flags ./flags
RUN python3 -m pip install --no-cache-dir --no-deps .

# A user without root; runs and data sets go to /work (mount a volume there).
RUN useradd --create-home --uid 1000 --user-group tfmulti \
    && mkdir -p /work/runs /work/data \
    && cp -r /opt/tfmulti/flags /work/flags \
    && chown -R 1000:1000 /work
USER 1000
WORKDIR /work

ENTRYPOINT ["python3", "-m", "tfmulti.main"]
