#!/usr/bin/env bash
# Fill DIR with wheels of requirements.txt and its whole dependency closure, for one Python version on
# manylinux x86_64, for installing on a machine without internet:
#
#     bash scripts/wheelhouse.sh DIR [PYTHON_VERSION]     # e.g. wheelhouse 3.12; default: this python3's
#
# Left out: torch, torchvision, triton and NVIDIA's CUDA libraries (nvidia-*, cuda-*), which a GPU machine
# already has with its own CUDA build (several GB). Needs internet (PyPI, or the index pip is configured for).
# On the target machine, offline: python3 scripts/install_missing.py DIR [--target T] installs what it lacks.
set -euo pipefail
dir=${1:?usage: bash scripts/wheelhouse.sh DIR [PYTHON_VERSION]}
# pip judges environment markers (python_version < ...), and older pips Requires-Python too, by the Python that
# runs it, whatever --python-version says: so python$ver runs it where there is one, else $PYTHON or python3.
ver=${2:-}
py=${PYTHON:-python3}
if [[ -z ${PYTHON:-} && -n $ver ]] && "python$ver" -c '' 2>/dev/null; then py=python$ver; fi
running=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
ver=${ver:-$running}
if [[ $ver != "$running" ]]; then
    echo "note: resolving for Python $ver with $py ($running); for exactly what $ver would pick: PYTHON=python$ver" >&2
fi
req=$(dirname "$0")/../requirements.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$dir"
# pip before 25.3 downloads every wheel of a --dry-run resolve, torch and CUDA's included (GBs): use a newer one.
if ! "$py" -c 'import pip, sys; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (25, 3))'; then
    if "$py" -m venv "$tmp/pip" && "$tmp/pip/bin/python" -m pip install --quiet 'pip>=25.3'; then
        py=$tmp/pip/bin/python
    else
        echo "note: with pip < 25.3 the resolve below downloads torch and the CUDA wheels too (GBs)" >&2
    fi
fi
pip=("$py" -m pip --disable-pip-version-check)
# Any glibc >= 2.28 machine (RHEL 8, Ubuntu 20.04 and later). pip does not expand manylinux_2_28 to the older
# manylinux_2_X tags by itself, so all are named (manylinux2014 brings manylinux2010 and manylinux1).
target=(--only-binary=:all: --python-version "$ver" --implementation cp --platform manylinux2014_x86_64)
for m in $(seq 28 -1 5); do target+=(--platform "manylinux_2_${m}_x86_64"); done

# 1. DeepSpeed is published as an sdist only. Built without torch (isolated build) it is a pure-python wheel
#    with no compiled ops (they are JIT-compiled on first use), good for any Python 3.
ds=$(grep -E '^deepspeed==' "$req")
"${pip[@]}" wheel --quiet --no-deps --wheel-dir "$tmp/ds" "$ds"
dswhl=$(ls "$tmp"/ds/deepspeed-*-py3-none-any.whl)   # fails here if the build was not pure python
cp "$dswhl" "$dir"/

# 2. Resolve the closure for that Python from metadata alone: the index's (PEP 658) where it has it, else
#    HTTP range requests into each wheel (fast-deps), so the GBs of torch and CUDA wheels are never fetched.
#    torch stays in the resolution so that every other version agrees with its pin; the built deepspeed wheel
#    replaces its sdist.
sed "s|^deepspeed==.*|$dswhl|" "$req" > "$tmp/req.txt"
"${pip[@]}" install --quiet --dry-run --ignore-installed --report "$tmp/report.json" --use-feature=fast-deps \
    "${target[@]}" --target "$tmp/t" -r "$tmp/req.txt"

# 3. Download each pin of the closure but torch, torchvision, triton, nvidia-*, cuda-* and deepspeed (built).
"$py" - "$tmp/report.json" > "$tmp/pins.txt" <<'EOF'
import json, re, sys
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if not re.fullmatch(r"torch|torchvision|triton|deepspeed|(nvidia|cuda)[-_.].*", name.lower()):
        print(f"{name}=={version}")
EOF
"${pip[@]}" download --quiet --no-deps "${target[@]}" --dest "$dir" -r "$tmp/pins.txt"

if ls "$dir" | grep -iE '^(torch|torchvision|triton|nvidia|cuda)[-_]'; then
    echo "wheelhouse.sh: the files above should not be in $dir" >&2
    exit 1
fi
echo "$dir: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sm "$dir" | cut -f1) MB, for Python $ver manylinux x86_64" \
     "(without torch, torchvision, triton, nvidia-*, cuda-*)"
