#!/usr/bin/env bash
# The GPU profile, for a lent GPU machine (torch with CUDA; CuPy for the device acceptance rule):
# scripts/gpu_profile.py against this checkout (no install needed), on SmolLM2-135M-shaped random
# weights, in under 3 minutes. Writes gpu_profile.json, gpu_profile.txt, cycle_trace.json.gz,
# gpu_profile.log and nvidia-smi.txt under $OUT (default: out/gpu_profile). Arguments go to
# gpu_profile.py (--smoke: the tiny model on the CPU stand-in device; --sections, --variants,
# --budget, --compile-limit to rerun a part); PROFILE_TIMEOUT (default 200 s) bounds the run.
#
# Exit codes: 0 done, 1 a section failed (the partial JSON is kept), 2 no GPU, 124 timed out.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/out/gpu_profile}"
mkdir -p "$OUT"
source "$ROOT/scripts/gpu_env.sh"
timeout "${PROFILE_TIMEOUT:-200}" python3 "$ROOT/scripts/gpu_profile.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_profile.log"
exit "${PIPESTATUS[0]}"
