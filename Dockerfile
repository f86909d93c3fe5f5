# tfmulti on the official TensorFlow GPU image of the version setup.py pins.
#
#   docker build -t tfmulti .
#   docker run --rm --init --gpus all --shm-size=1g --ulimit memlock=-1 \
#       -v "$PWD/runs:/work/runs" tfmulti --num_gpus=2
#
# The entrypoint is the main job; other entry points through --entrypoint python3:
#   docker run ... --entrypoint python3 tfmulti -m tfmulti.doctor --num_gpus=2
# See the README ("Containers") for data mounts, tuning sessions and multi-worker jobs.
#
# BASE: another image with Python 3 and TensorFlow 2.21 installed system-wide, such as the
# Debian stand-in `make container-test` makes on machines that cannot reach Docker Hub.
# No network in the build? Put the wheels into wheels/ (see wheels/README.md) and add
# --build-arg PIP_NO_INDEX=1. With wheels/ empty, pip takes everything from PyPI as before.
ARG BASE=tensorflow/tensorflow:2.21.0-gpu
FROM ${BASE}
ARG PIP_NO_INDEX

# Unbuffered logs; no .pyc files in the image; pip quiet and without a cache layer.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_CPP_MIN_LOG_LEVEL=2

# TCMalloc (docs/performance.md, "The memory allocator"): from apt unless the base has it; a
# build without network goes on without it (the doctor then says so). Not pinned: the version
# is the base distribution's own. Every process of the image preloads it through one fixed
# path (its folder depends on the architecture); without TCMalloc that path names glibc's own
# libc, already loaded: the system's malloc, and no loader error on every command.
# hadolint ignore=DL3008
RUN { ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
           --no-install-recommends libtcmalloc-minimal4 && rm -rf /var/lib/apt/lists/*; } \
      || echo "TCMalloc not installed: the image uses glibc's malloc"; } \
    && for lib in /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 /lib/*-linux-gnu/libc.so.6 \
                  /usr/lib/*-linux-gnu/libc.so.6; do [ -e "$lib" ] && break; done \
    && ln -sf "$lib" /usr/local/lib/libtfmulti-malloc.so
ENV LD_PRELOAD=/usr/local/lib/libtfmulti-malloc.so \
    TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=1099511627776

# Dependencies first (a layer that changes only with setup.py), TensorFlow from the base image.
WORKDIR /opt/tfmulti
COPY setup.py README.md ./
COPY wheels/ /tmp/wheels/
RUN mkdir tfmulti && touch tfmulti/__init__.py \
    && python3 -m pip install --no-cache-dir --find-links /tmp/wheels . \
    && python3 -m pip uninstall --yes tfmulti \
    && rm -rf /tmp/wheels \
    && python3 -c "import tensorflow as tf; v = tf.__version__; assert v.startswith('2.21.'), v"

# The package itself: a small layer.
COPY tfmulti ./tfmulti
COPY flags ./flags
RUN python3 -m pip install --no-cache-dir --no-deps .

# A user without root, uid 1000 (bases that already have one, as Ubuntu 24.04's "ubuntu", keep
# theirs); runs and data sets go to /work (mount a volume there).
RUN (id -u 1000 >/dev/null 2>&1 || useradd --create-home --uid 1000 --user-group tfmulti) \
    && mkdir -p /work/runs /work/data \
    && cp -r /opt/tfmulti/flags /work/flags \
    && chown -R 1000:1000 /work
USER 1000
WORKDIR /work

ENTRYPOINT ["python3", "-m", "tfmulti.main"]
