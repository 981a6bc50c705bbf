#!/usr/bin/env bash
# The GPU acceptance check, on the Python a GPU node already has (docs/gpu.md):
#
#     bash tests/gpu_check.sh [PYTHON]      # default: $GPU_CHECK_PYTHON, else python3 on PATH
#
# 1. Says which of torch, transformers, pytest, deepspeed, vllm, math-verify and peft import in PYTHON, with their
#    versions. A node with GPUs (nvidia-smi lists them, or /dev/nvidia0... exist) whose torch cannot use them
#    fails here, in one line: every GPU test would skip.
# 2. On a CUDA node, installs what is missing into PYTHON's environment at requirements.txt's pins, one
#    package at a time, from the wheels in $GPU_CHECK_WHEELS (no index: an offline node) or else the
#    package index, holding every distribution already installed at its version (a constraint on each: the
#    node's torch, its CUDA libraries and triton are never replaced or re-resolved; a module's __version__,
#    such as torch's 2.11.0+cu130 beside a distribution 2.11.0, is not what pip matches). An install that
#    cannot happen (no network, a conflict with what the node holds, a read-only environment) is said in one
#    line, and the check goes on with what there is. tests/gpu_wheels.sh makes such a wheel directory on a
#    machine with network. PYTHON and GPU_CHECK_WHEELS may be given relative to the folder it is run from.
# 3. Runs tests/test_gpu.py: the update path at real shapes wherever DeepSpeed imports, the rollout and
#    weight-sync checks where vLLM and math-verify do too (the update path prints which attention ran: on CUDA it
#    must be the flash kernel attention_kind reports), and LoRA's (--lora-rank: its update, its merged sync)
#    where peft does; each skip says what is missing, and the check names
#    every package whose absence skipped a test. Then, on CUDA with DeepSpeed,
#    the update benchmark (bench_step.py --update-only at each of $GPU_CHECK_SHAPES, default
#    "qwen2.5-1.5b qwen2.5-3b": docs/gpu.md's MFU table, at the trainer's CUDA defaults).
# GPU_CHECK_DEV: where the driver's device nodes are looked for (default /dev).
# Without a CUDA device nothing is installed and every GPU test skips; GPU_CHECK_FORCE=1 tries the
# install anyway (to check an offline wheel directory on any machine). Exit status: the tests', and non-zero
# on a node with a GPU (torch or nvidia-smi sees one) where the update path was not checked, with one line
# saying why: a check that checked nothing never passes there. The rollout checks skip without vLLM or
# math-verify, said as a skip with its reason, not a failure.
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
# a path given relative to the caller's folder; a bare command name is looked up on PATH
from_caller() { case "$1" in /*) echo "$1" ;; */*) echo "$caller/$1" ;; *) echo "$2" ;; esac; }
py=${1:-${GPU_CHECK_PYTHON:-python3}}
py=$(from_caller "$py" "$py")
wheels=${GPU_CHECK_WHEELS:+$(from_caller "$GPU_CHECK_WHEELS" "$caller/$GPU_CHECK_WHEELS")}
say() { echo "[gpu check] $*"; }
if ! command -v "$py" >/dev/null 2>&1; then
  say "error: no Python at '$py' (pass one: bash tests/gpu_check.sh /path/to/python)"
  exit 1
fi
PACKAGES=(torch transformers pytest deepspeed vllm math_verify peft)  # modules; requirements.txt names them with '-'

# name=version (or name=-) for every package (its distribution's version where the module has none),
# hold=DIST==VERSION for every installed distribution (what pip matches) whose version pip can pin (PEP 440; a
# system Python's distro-info 1.1build1 is not, and pip 24.1 and later refuse such a constraint line: it stays
# unheld, unheld=DIST VERSION), then cuda=N (devices torch sees)
probe() {
  "$py" - "${PACKAGES[@]}" 2>/dev/null <<'EOF'
import importlib, importlib.metadata as md, sys
try:
    from packaging.version import InvalidVersion, Version
except ImportError:  # a bare environment: pip's own copy
    try:
        from pip._vendor.packaging.version import InvalidVersion, Version
    except ImportError:  # no pip: nothing is installed anyway
        InvalidVersion, Version = ValueError, str
dists = md.packages_distributions()
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
        print(f"{name}={getattr(module, '__version__', None) or md.version(dists[name][0])}")
    except Exception:  # not installed, or installed and broken: either way it does not import
        print(f"{name}=-")
held, unheld = {}, {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if name:  # a distribution with broken metadata names nothing pip could match
        key = name.lower().replace("_", "-")
        try:
            Version(dist.version)
            held.setdefault(key, f"{name}=={dist.version}")
        except InvalidVersion:
            unheld.setdefault(key, f"{name} {dist.version}")
print("\n".join(f"hold={h}" for h in sorted(held.values())))
print("\n".join(f"unheld={u}" for k, u in sorted(unheld.items()) if k not in held))
try:
    import torch
    print(f"cuda={torch.cuda.device_count() if torch.cuda.is_available() else 0}")
except Exception:
    print("cuda=0")
EOF
}
version() { sed -n "s/^$1=//p" <<<"$state"; }
# the requirements of installed distribution $1 (extras and other platforms' aside) that no installed one meets
unmet_requirements() {
  "$py" - "$1" <<'EOF'
import importlib.metadata as md, sys
try:
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion
except ImportError:  # a bare environment: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import InvalidVersion
for line in md.requires(sys.argv[1]) or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        met = req.specifier.contains(md.version(req.name), prereleases=True)
    except md.PackageNotFoundError:
        met = False
    except InvalidVersion:  # installed at a version nothing can compare (1.1build1): met only where none is asked
        met = not req.specifier
    if not met:
        print(str(req).split(";")[0].replace(" ", ""))
EOF
}
missing() { for p in "${PACKAGES[@]}"; do [ "$(version "$p")" = "-" ] && echo "$p"; done; }
report() { say "$py: $(for p in "${PACKAGES[@]}"; do printf '%s %s, ' "${p//_/-}" "$(version "$p")"; done | sed 's/, $//; s/ -/ missing/g')"; }

state=$(probe)
report
gpus=$(version cuda)
seen="torch"
if [ "${gpus:-0}" = 0 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | wc -l) seen="nvidia-smi"  # a CUDA node whose Python lacks a CUDA torch
fi
devices=$(ls -d "${GPU_CHECK_DEV:-/dev}"/nvidia[0-9]* 2>/dev/null | wc -l)  # the driver's device nodes
if [ "${gpus:-0}" = 0 ] && [ "$devices" -gt 0 ]; then
  gpus=$devices seen="${GPU_CHECK_DEV:-/dev}/nvidia*"
fi
if [ "${gpus:-0}" -gt 0 ]; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/[gpu check] GPU /'
  # what the node needs before anything runs: a driver for CUDA 13 (torch 2.13's and vLLM 0.32's builds), and a C
  # compiler and Python's headers, with which Triton builds its launchers at first use (triton/runtime/build.py:
  # $CC, else clang or gcc on PATH)
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  if [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ] 2>/dev/null; then
    say "error: NVIDIA driver $driver is older than 580, which torch 2.13's and vLLM 0.32's CUDA 13 builds need:" \
      "update the driver (nothing was checked)"
    exit 1
  fi
  node=()
  if [ -n "${CC:-}" ] && ! command -v "$CC" >/dev/null 2>&1; then
    node+=("CC=$CC is not a compiler on PATH: Triton compiles with it; unset CC, or point it at gcc or clang")
  elif [ -z "${CC:-}" ] && ! command -v gcc >/dev/null 2>&1 && ! command -v clang >/dev/null 2>&1; then
    node+=("no C compiler (gcc or clang) on PATH: Triton compiles its launchers with one (apt-get install gcc)")
  fi
  if ! "$py" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
    node+=("no Python.h for $py: Triton compiles against Python's headers (apt-get install python3-dev, or the" \
      "headers of the Python you run)")
  fi
  for problem in "${node[@]}"; do say "error: $problem"; done
  [ ${#node[@]} -eq 0 ] || exit 1
  if [ "$(version torch)" != "-" ] && [ "$(version cuda)" = 0 ]; then
    say "error: $seen shows ${gpus} GPU(s) but torch $(version torch) in $py cannot use them (a CPU build, or" \
      "a driver older than its CUDA): nothing was checked"
    exit 1
  fi
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
  unheld=$(version unheld)
  if [ -n "$unheld" ]; then
    say "not held (not PEP 440 versions, pip cannot pin them): $(paste -sd, <<<"$unheld" | sed 's/,/, /g')"
  fi
  source_args=(--retries 0 --timeout 15)
  if [ -n "$wheels" ]; then
    source_args=(--no-index --find-links "$wheels")
  fi
  pip=("$py" -m pip install --disable-pip-version-check -q -c "$hold" "${source_args[@]}")
  for m in $todo; do
    p=${m//_/-}
    spec=$(grep -E "^$p([=<>!~ ]|$)" requirements.txt | sed 's/#.*//; s/ //g')
    # the package alone, then only those of its requirements that nothing installed meets: what is installed
    # (torch above all) is never resolved again, so its own requirements cannot pull anything in or out
    if log=$("${pip[@]}" --no-deps "${spec:-$p}" 2>&1) && unmet=$(unmet_requirements "$p") \
        && log=$( [ -z "$unmet" ] || "${pip[@]}" $unmet 2>&1); then
      say "installed ${spec:-$p}${unmet:+ with $(tr '\n' ' ' <<<"$unmet" | sed 's/ $//')}"
    else
      "$py" -m pip uninstall -y -q "$p" >/dev/null 2>&1  # not half of it: the node as it was
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
  say "error: $seen shows ${gpus} GPU(s) but torch $(version torch) in $py cannot use them (a CPU build, or" \
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
fi
absent=$(for m in vllm math_verify; do [ "$(version "$m")" = "-" ] && printf '%s, ' "${m//_/-}"; done)
if [ -n "$absent" ]; then
  say "skipped, not failed: the rollout and weight-sync checks (not installed in $py: ${absent%, })"
fi
if [ "$(version peft)" = "-" ]; then
  say "skipped, not failed: the LoRA checks (not installed in $py: peft)"
fi
rm -f "$results"
if [ "$(version cuda)" -gt 0 ] && [ "$(version deepspeed)" != "-" ]; then
  for shape in ${GPU_CHECK_SHAPES:-qwen2.5-1.5b qwen2.5-3b}; do
    start=$SECONDS
    "$py" -m deepspeed.launcher.runner --num_gpus "$(version cuda)" --master_port 29673 --module scripts.bench_step --update-only \
      --shape "$shape" --out "bench_update_$shape.json" || status=1
    say "update benchmark, $shape: $((SECONDS - start)) s"
  done
fi
exit "$status"
