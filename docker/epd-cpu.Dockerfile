# EPD for machines without a GPU: every service, Triton's included (the
# tritonserver binary and its Python backend from the nvidia-pytriton wheel, run
# by `epd triton` as `epd serve` runs it), on torch's CPU build. Build context:
# the repository root (compose.cpu.yaml builds it).
#
# BASE: a Debian bookworm image. The default is the public Python image; where
# no registry is reachable, a local one (README, "Docker Compose": mmdebstrap and
# docker import), whose Python comes from Debian here.
#
# Python packages come from docker/wheels/ where it holds wheels (an offline
# build: docker/wheelhouse.sh fills it from the host's package indexes), else from
# PyPI and PyTorch's CPU index.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

# The C kernels are compiled on first use for the CPU they run on (-march=native,
# services/layers/cpu_kernels.py), so a C compiler is a run-time need; the
# builds are kept in the epd-cache volume (EPD_CACHE_DIR). Triton's Python stub
# links libpython by name: Debian's Python has it in a package of its own.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && if ! command -v python3 >/dev/null; then \
      apt-get install -y --no-install-recommends python3 python3-venv \
      && apt-get install -y --no-install-recommends \
           "lib$(python3 -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"; \
    fi \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    EPD_CACHE_DIR=/var/cache/epd
RUN python3 -m venv /opt/venv

# The dependencies first, from pyproject.toml alone, so that a change to the code
# rebuilds only the layers after them. The tritonserver wheel's metadata pins
# numpy<2 and packages its binary never uses, hence --no-deps for it. xgrammar
# asks for triton (OpenAI's compiler, 1 GB) for its GPU kernels only: on a CPU
# it masks logits without it, so it goes.
WORKDIR /opt/epd
COPY pyproject.toml ./
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    mkdir -p services && touch README.md services/__init__.py \
 && if ls /wheels/*.whl >/dev/null 2>&1; then \
      set -- --no-index --find-links /wheels; \
    else \
      set -- --extra-index-url "$TORCH_INDEX"; \
    fi \
 && pip install --no-cache-dir "$@" setuptools . \
 && pip install --no-cache-dir "$@" --no-deps "nvidia-pytriton==0.7.0" \
 && pip uninstall -y epd-serve triton \
 && rm -rf services README.md

COPY README.md ./
COPY protos protos
COPY model_repository model_repository
COPY services services
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && useradd --create-home --uid 1000 epd \
 && mkdir -p /var/cache/epd /models/checkpoint \
 && chown epd:epd /var/cache/epd /models/checkpoint

USER epd
EXPOSE 8000 8001 50051 50061 50071
CMD ["epd", "--help"]
