#!/usr/bin/env bash
# The GPU check, for a lent GPU machine (torch with CUDA; CuPy for the CuPy-device check).
# Runs scripts/gpu_check.py against this checkout (no install needed) and writes
# gpu_check.json, gpu_check.png, gpu_check.log and nvidia-smi.txt under $OUT
# (default: out/gpu_check). Bounded to 7m50s. Exit codes: 0 passed, 1 a check failed,
# 2 no GPU (a clear message says so), 124 timed out.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/out/gpu_check}"
mkdir -p "$OUT"
SITE="$(mktemp -d)"  # `dspark` -> this checkout, as the editable install maps it
mkdir -p "$SITE/dspark"
ln -s "$ROOT/export" "$SITE/dspark/export"
ln -s "$ROOT/runtime" "$SITE/dspark/runtime"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi: not available") \
  > "$OUT/nvidia-smi.txt" 2>&1
timeout 470 python "$ROOT/scripts/gpu_check.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
rm -rf "$SITE"
exit "$rc"
