#!/usr/bin/env bash
# One GPU check on one H100/H200: installs the GPU runtime first (untimed: requirements/gpu.txt into
# .venv-gpu, the time printed apart), then <= 9 min of checks: SmolLM2 served by `vllm serve`, our
# `process` rollouts against `vllm bench serve` at the same concurrency, 20 bf16 SFT steps (MFU),
# 5 GRPO steps with vLLM colocated, and a tiny round on CUDA; writes a JSON summary.
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
GPU_VENV=${GPU_VENV:-.venv-gpu}
mkdir -p "$OUT_DIR"
started=$(date +%s)
if ! "$GPU_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    # A fresh environment: a failed or cut-off install never leaves the project's own torch half-replaced.
    python3 -m venv "$GPU_VENV"
    "$GPU_VENV/bin/pip" install -q -r requirements/gpu.txt >"$OUT_DIR/install.log" 2>&1
    "$GPU_VENV/bin/pip" install -q --no-deps -e . >>"$OUT_DIR/install.log" 2>&1
fi
echo "{\"install_seconds\": $(( $(date +%s) - started ))}" | tee "$OUT_DIR/install.json"
export FLYWHEEL_GPU_PYTHON="$GPU_VENV/bin/python" FLYWHEEL_CLI="$(dirname "$PY")/flywheel"
PYTHONUNBUFFERED=1 timeout 540 "$FLYWHEEL_GPU_PYTHON" scripts/gpu_check.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/gpu_check.log"
