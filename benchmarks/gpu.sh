#!/usr/bin/env bash
# One prepared GPU run (benchmarks/gpu.py): at most 8 minutes on one large CUDA GPU, no downloads.
#
#   benchmarks/gpu.sh                 # on the GPU machine: writes benchmarks/RESULTS.md
#   benchmarks/gpu.sh --out PATH      # writes PATH instead (a copy of RESULTS.md is made there first)
#   benchmarks/gpu.sh --dry-run       # tiny sizes on the CPU, into a temporary copy
#
# The package is imported from this checkout's src/ (no install: it is pure Python, and its
# core needs, torch, numpy, scipy, safetensors and tqdm, are on a CUDA image). diffusers, for
# the transformer and SDXL scheduler stages, is imported if installed, else installed offline from
# the wheels in $SPECFOREST_WHEELS (default: .whl in the checkout); without it those stages are
# skipped and say so. The SDXL stages (an SDXL-base-sized UNet at 1024x1024 with Euler ancestral
# and DPM++ 2M SDE, benchmarks/gpu_schedulers.py) also need transformers (on a CUDA image) for
# their text encoders and tokenizer, built in code. The budget in seconds is $SPECFOREST_GPU_BUDGET
# (default 450; gpu.py keeps to it and this script stops it 30 s after); other options pass
# through to gpu.py (--only STAGES, --json PATH).
# The interpreter is $PYTHON, default the checkout's .venv/bin/python where it exists, else python3.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# the checkout's venv (make venv) where there is one, else the machine's python3 (a CUDA image's)
default_python=python3
[[ -x "$root/.venv/bin/python" ]] && default_python="$root/.venv/bin/python"
python="${PYTHON:-$default_python}"
budget="${SPECFOREST_GPU_BUDGET:-450}"
wheels="${SPECFOREST_WHEELS:-$root/.whl}"

export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if ! "$python" -c "import diffusers" 2>/dev/null; then
    if compgen -G "$wheels/*.whl" >/dev/null; then
        site="$(mktemp -d)"
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
        export PYTHONPATH="$PYTHONPATH:$site"
    else
        echo "[gpu.sh] diffusers is not importable and $wheels holds no wheels: the transformer and SDXL stages will be skipped" >&2
    fi
fi

# a copy of the results file where --out names a new one, so that only its sections change
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    if [[ "${args[i]}" == "--out" && $((i + 1)) -lt ${#args[@]} && ! -e "${args[i + 1]}" ]]; then
        mkdir -p "$(dirname "${args[i + 1]}")"
        cp "$root/benchmarks/RESULTS.md" "${args[i + 1]}"
    fi
done

# gpu.py keeps to the budget by itself (each stage in a time box); this is the backstop
exec timeout -k 10 "$((budget + 30))" "$python" "$root/benchmarks/gpu.py" --budget "$budget" "$@"
