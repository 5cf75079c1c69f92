#!/usr/bin/env bash
# Creates the venv ($EPD_VENV, default .venv) and installs the project into it:
#   scripts/setup.sh serve   what `epd serve` needs (`make serve`)
#   scripts/setup.sh test    and the test tools: the dev extras and, as root with
#                            apt, Debian's kubectl, Prometheus, Docker and mmdebstrap
# Idempotent: re-runs only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE="${1:-serve}"
case "$MODE" in
  serve | test) ;;
  *) echo "usage: scripts/setup.sh [serve|test]" >&2; exit 2 ;;
esac
VENV="${EPD_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.epd-installed-$MODE"
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

for done in "$STAMP" "$VENV/.epd-installed-test"; do  # a test install serves too
  if [[ -f "$done" && "$(cat "$done")" == "$WANT" ]]; then
    exit 0
  fi
done

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" --upgrade pip
# The CPU build of torch that lies on this machine's disk; any torch>=2.4 works
# elsewhere (GPU machines bring their own CUDA build).
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch==2.13.0"
fi
# The tritonserver binary and its Python backend ship inside this wheel. Its
# metadata pins numpy<2 and Python deps the binary never uses, hence --no-deps.
"${PIP[@]}" --no-deps "nvidia-pytriton==0.7.0"
if [[ "$MODE" == serve ]]; then
  "${PIP[@]}" -e .
  echo "$WANT" > "$STAMP"
  exit 0
fi
"${PIP[@]}" -e ".[dev]"
# transformers' video processor, the reference of the video tests, needs
# torchvision's Python transforms. Its wheel cannot load its C ops beside the
# CPU torch and would make transformers pick torchvision-backed processors, so
# it lives in a folder of its own that only the tests' reference child puts on
# its path (tests/videos.py). 0.28 is torch 2.13's torchvision.
"${PIP[@]}" --no-deps --upgrade --target "$VENV/reference" "torchvision==0.28.0"

# tests/test_kubernetes.py renders deploy/kubernetes/ with kubectl's built-in
# Kustomize: Debian's kubectl, where this machine lets us install it.
if ! command -v kubectl >/dev/null && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
  apt-get install -y -qq kubectl >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq kubectl >/dev/null 2>&1; } \
    || echo "kubectl could not be installed: tests/test_kubernetes.py will skip"
fi

# tests/test_observability.py runs a real Prometheus against the stack with the
# shipped scrape configuration and the dashboards' queries: Debian's package.
if ! command -v prometheus >/dev/null && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
  apt-get install -y -qq prometheus >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq prometheus >/dev/null 2>&1; } \
    || echo "prometheus could not be installed: tests/test_observability.py will skip"
fi

# tests/test_containers.py builds the images and runs the stack in real
# containers: Debian's Docker engine (the tests start its daemon) and mmdebstrap
# (a local base image where no registry is reachable).
if ! { command -v dockerd && command -v mmdebstrap; } >/dev/null && [[ "$(id -u)" == 0 ]] \
    && command -v apt-get >/dev/null; then
  apt-get install -y -qq docker.io mmdebstrap >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq docker.io mmdebstrap >/dev/null 2>&1; } \
    || echo "docker.io could not be installed: tests/test_containers.py will skip"
fi

echo "$WANT" > "$STAMP"
