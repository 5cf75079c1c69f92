#!/usr/bin/env bash
# Fills docker/wheels/ with every wheel the CPU image installs, from this
# machine's package indexes, for image builds that cannot reach them
# (docker/epd-cpu.Dockerfile installs from it when it holds wheels). The torch
# build is the one installed in the project's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-${EPD_VENV:-.venv}/bin/python}"  # the venv scripts/setup.sh made
OUT=docker/wheels
TORCH="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
# What the wheels were gathered for: the project's dependencies, the torch build and
# this script. Unchanged, there is nothing to do; changed, the folder is filled anew
# (wheels from before a dependency change would build an image of the old packages).
STAMP="$OUT/.gathered-for"
WANT="$(cat pyproject.toml docker/wheelhouse.sh | sha256sum | cut -d' ' -f1) torch $TORCH"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
rm -f "$OUT"/*.whl "$STAMP"
PIP=("$PY" -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$OUT")
"${PIP[@]}" "torch==$TORCH" setuptools .
"${PIP[@]}" --no-deps "nvidia-pytriton==0.7.0"
rm -f "$OUT"/epd_serve-*.whl  # the code goes in a layer of its own
echo "$WANT" >"$STAMP"
du -sh "$OUT"
