#!/usr/bin/env bash
# One GPU check, <= 9 min on one H100/H200: installs the gpu extra, serves SmolLM2 with `vllm serve`,
# measures our `process` rollouts against `vllm bench serve` at the same concurrency, 20 bf16 SFT steps
# (MFU), 5 GRPO steps with vLLM colocate, and a tiny round on CUDA; writes a JSON summary.
#   scripts/gpu_check.sh [OUT_DIR]          (default: ./gpu_check; the summary is OUT_DIR/gpu_check.json)
#   scripts/gpu_check.sh --dry-run          (any machine: print the steps and commands it would run)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ "${1:-}" = "--dry-run" ]; then
    exec "$PY" scripts/gpu_check.py --dry-run
fi
OUT_DIR=${1:-gpu_check}
mkdir -p "$OUT_DIR"
if ! "$PY" -c "import vllm" 2>/dev/null; then
    # The gpu extra (vLLM, DeepSpeed); a machine without a package index records the failure and goes on.
    timeout 240 "$PY" -m pip install -q -e ".[gpu]" >"$OUT_DIR/install.log" 2>&1 || echo "gpu extra: install failed (see install.log)"
fi
PYTHONUNBUFFERED=1 timeout 500 "$PY" scripts/gpu_check.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/gpu_check.log"
