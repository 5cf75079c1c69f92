#!/usr/bin/env bash
# Fills docker/wheels/ with every wheel the CPU image installs, from this
# machine's package indexes, for image builds that cannot reach them
# (docker/epd-cpu.Dockerfile installs from it when it holds wheels). The torch
# build is the one installed in the project's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT=docker/wheels
TORCH="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
PIP=("$PY" -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$OUT")
"${PIP[@]}" "torch==$TORCH" setuptools .
"${PIP[@]}" --no-deps "nvidia-pytriton==0.7.0"
rm -f "$OUT"/epd_serve-*.whl  # the code goes in a layer of its own
du -sh "$OUT"
