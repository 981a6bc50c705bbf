#!/usr/bin/env bash
# The GPU acceptance check on a bare CUDA machine: install requirements.txt into a venv, then run
# tests/test_gpu.py, printing each phase's seconds and the peak GPU memory. Without a CUDA device
# it says so and exits 0, having installed nothing.
#
#     bash tests/gpu_check.sh          # GPU_CHECK_VENV=DIR to use another venv (default .venv-gpu)
#
# The venv sees the system's packages (--system-site-packages), so an image that already holds a
# CUDA torch, vLLM and DeepSpeed of the required versions installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[gpu check] skipped: no CUDA device (nvidia-smi finds none)"
  exit 0
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | sed 's/^/[gpu check] GPU /'
venv=${GPU_CHECK_VENV:-.venv-gpu}
start=$SECONDS
[ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q -r requirements.txt pytest
echo "[gpu check] install: $((SECONDS - start)) s"
start=$SECONDS
status=0
"$venv/bin/python" -m pytest -q -s -rs tests/test_gpu.py || status=$?
echo "[gpu check] tests: $((SECONDS - start)) s"
exit "$status"
