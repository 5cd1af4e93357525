#!/usr/bin/env bash
# The GPU check, for a lent GPU machine (torch with CUDA; CuPy for the CuPy-device check).
# Runs scripts/gpu_check.py against this checkout (no install needed) and writes
# gpu_check.json, gpu_check.png, gpu_check.log and nvidia-smi.txt under $OUT
# (default: out/gpu_check). The checks are bounded to 6m40s.
#
# Real weights: when .gpu/gguf.sha256 is here (scripts/gpu_prep.sh wrote it, and earlier calls
# carried .gpu/gguf.part1..N), the GGUF is reassembled under $GGUF_DIR and verified, the wheels
# of .gpu/whl are installed into $WHEEL_SITE, and the check runs on the GGUF target, the shipped
# drafter and .gpu/prompts.json. Without .gpu/gguf.sha256 (or with --smoke): random weights.
# When a part is missing or corrupt, a message names it and the checks run on random weights, so
# that the call still measures something; the exit code is then 3.
# A call that carries .gpu/ replaces the whole folder on the device, so each part is stashed under
# $GGUF_DIR/parts as it arrives: `gpu_check.sh --stash` does only that (every call but the last;
# scripts/gpu_weights.sh).
#
# Exit codes: 0 passed, 1 a check failed, 2 no GPU (a clear message says so), 3 the real
# weights are incomplete or corrupt (a message names the part), 124 timed out.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/out/gpu_check}"
mkdir -p "$OUT"
source "$ROOT/scripts/gpu_env.sh"  # `dspark` -> this checkout; nvidia-smi.txt; the environment
source "$ROOT/scripts/gpu_weights.sh"  # stash_parts, assemble_gguf
: > "$OUT/gpu_check.log"
if [ "${1:-}" = "--stash" ]; then stash_parts; exit 0; fi

args=("$@")

real_weights() {  # the GGUF, reassembled and verified, or `incomplete` says why not
  assemble_gguf
  [ -n "$incomplete" ] && return
  args+=(--gguf "$GGUF_DIR/target.gguf" --prompts "$GPU/prompts.json")
  echo "gpu_check: real weights, $(stat -c %s "$GGUF_DIR/target.gguf") bytes of GGUF verified" | tee -a "$OUT/gpu_check.log"
}

if [ -f "$GPU/gguf.sha256" ] && [[ " $* " != *" --smoke "* ]]; then
  real_weights
  if [ -n "$incomplete" ]; then
    echo "gpu_check: $incomplete; the checks run on random weights instead, and the exit code is 3" \
      | tee -a "$OUT/gpu_check.log" >&2
  fi
fi
timeout 400 python3 "$ROOT/scripts/gpu_check.py" --out "$OUT" "${args[@]}" 2>&1 | tee -a "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
if [ -n "$incomplete" ] && [ "$rc" -ne 124 ]; then
  echo "gpu_check: NOT on real weights: $incomplete" | tee -a "$OUT/gpu_check.log" >&2
  exit 3
fi
exit "$rc"
