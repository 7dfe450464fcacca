#!/usr/bin/env bash
# The GPU check (docs/gpu.md, "The GPU check"): on a machine with one CUDA GPU, in under 9 minutes, the parts only a
# GPU can prove, then one table and OUT_DIR/report.json. On a machine without internet, name a folder of wheels made
# beforehand by `make wheelhouse`: what this python3 lacks is installed from it into its environment (a virtual
# environment of your own, say), torch and CUDA being the machine's. PYTHON=... picks another python.
#
#     bash scripts/gpu_check.sh OUT_DIR [WHEEL_DIR]
set -euo pipefail
export GPU_CHECK_STARTED=$(date +%s.%N)  # the budget counts the install below
out=$(realpath -m "${1:?usage: bash scripts/gpu_check.sh OUT_DIR [WHEEL_DIR]}")
wheels=${2:+$(realpath "$2")}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [[ -n $wheels ]]; then
    "$py" scripts/install_missing.py "$wheels"
fi
export HF_HUB_OFFLINE=1
exec "$py" scripts/gpu_check.py "$out" "${@:3}"
