#!/usr/bin/env bash
# The GPU issue's checks in priority order, in one run that fits a short lease (benchmarks/gpu_check.py).
# On a lent GPU machine (bare, no registry): the wheels carried in .whl/ (fetched for its Python 3.12, see
# docs/gpu.md) are installed first; another Python (a rehearsal here) uses its own packages.
#   bash benchmarks/gpu_check.sh [OUT] [gpu_check.py options]   # OUT: default $OUT, else results/gpu-check
# Without CUDA it rehearses every part on tiny CPU models and says the CUDA parts were skipped.
set -u
cd "$(dirname "$0")/.."
out="${1:-${OUT:-results/gpu-check}}"
shift || true
mkdir -p "$out"
python="${PYTHON:-python3}"
if ls .whl/*.whl >/dev/null 2>&1 && "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "could not install the carried wheels"; exit 1; }
  export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# fail at once, not part by part, when a carried wheel's own needs are missing there
"$python" -c "import specbench.api, specbench.worker.server, transformers.models.qwen2, huggingface_hub.hf_api" \
  || { echo "the packages do not import: carry the missing wheels in .whl/ (docs/gpu.md)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec "$python" benchmarks/gpu_check.py --out "$out" "$@"
