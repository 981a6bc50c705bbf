#!/usr/bin/env bash
# The wheel directory tests/gpu_check.sh installs from on a GPU node without network (docs/gpu.md). Run it on a
# machine with network and a Python that has torch (DeepSpeed's build imports it):
#
#     bash tests/gpu_wheels.sh DIR [NODE_PYTHON_VERSION] [NODE_PLATFORM]    # default: 3.12 manylinux_2_28_x86_64
#     # copy DIR to the node, then there: GPU_CHECK_WHEELS=DIR bash tests/gpu_check.sh
#
# DeepSpeed has no binary wheel: its sdist is built once, without ops (DS_BUILD_OPS=0: a pure-Python wheel; the
# trainer uses torch's AdamW and JIT-builds nothing on CUDA). Its dependencies are downloaded as binary wheels
# for the node's Python and platform, torch excepted (the node keeps its own); pip installs only those the node
# lacks. GPU_WHEELS_EXTRA adds packages (for example "pytest transformers<5.20" where the node has neither).
set -euo pipefail
out=${1:?usage: bash tests/gpu_wheels.sh DIR [NODE_PYTHON_VERSION] [NODE_PLATFORM]}
pyver=${2:-3.12}
platform=${3:-manylinux_2_28_x86_64}
py=${GPU_WHEELS_PYTHON:-python3}
# DIR and GPU_WHEELS_PYTHON relative to the folder it is run from (a bare command name is looked up on PATH)
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
case "$py" in /*) ;; */*) py="$PWD/$py" ;; esac
cd "$(dirname "$0")/.."
ds=$(sed -n 's/^\(deepspeed==[^ #]*\).*/\1/p' requirements.txt)
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "$ds"
tar -xzf "$tmp"/deepspeed-*.tar.gz -C "$tmp"
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$tmp"/deepspeed-*/
wheel=$(ls "$out"/deepspeed-*.whl)
# its Requires-Dist lines, but torch and those for extras
mapfile -t deps < <("$py" - "$wheel" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        req = line.removeprefix("Requires-Dist: ")
        if req != line and "extra ==" not in req and not req.split(";")[0].strip().startswith("torch"):
            print(req)
EOF
)
read -r -a extra <<<"${GPU_WHEELS_EXTRA:-}"
"$py" -m pip download -q --only-binary :all: --python-version "$pyver" --implementation cp \
  --platform "$platform" --platform manylinux2014_x86_64 --platform any -d "$out" "${deps[@]}" "${extra[@]}"
echo "[gpu wheels] $out: $(ls "$out" | wc -l) wheels, $(du -sh "$out" | cut -f1) (for Python $pyver, $platform):" \
  "$(ls "$out" | sed 's/-py[23].*//; s/-cp3.*//' | tr '\n' ' ')"
