#!/usr/bin/env bash
# The drafter's GPU route, for a lent GPU machine (torch with CUDA, transformers): runs
# scripts/gpu_train.py against this checkout (no install needed) on the real GGUF, and writes
# gpu_train.json, gpu_train.log, nvidia-smi.txt, result.tar.partNN and result.sha256 under $OUT
# (default: out/gpu_train). Bounded to 9m30s.
#
# Real weights: prepared here by scripts/gpu_prep.sh (.gpu/: the GGUF in N parts, its sha256, the
# gguf wheel, the training prompts). Every call but the last carries one part and runs
# `gpu_train.sh --stash`; the last carries the last part and the rest of .gpu/ and runs
# `gpu_train.sh [gpu_train.py options]`, which reassembles and verifies the GGUF first.
# `--target PATH` skips all of that (the tests' tiny-scale rehearsal: --target TINY --device cpu).
#
# Exit codes: 0 done, 1 a stage failed, 2 no GPU, 3 the GGUF is incomplete or corrupt (a message
# names the part), 124 timed out.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/out/gpu_train}"
mkdir -p "$OUT"
source "$ROOT/scripts/gpu_env.sh"  # `dspark` -> this checkout; nvidia-smi.txt; the environment
source "$ROOT/scripts/gpu_weights.sh"  # stash_parts, assemble_gguf
: > "$OUT/gpu_train.log"
if [ "${1:-}" = "--stash" ]; then stash_parts; exit 0; fi

args=("$@")
if [[ " $* " != *" --target "* ]]; then
  assemble_gguf
  if [ -n "$incomplete" ]; then
    echo "gpu_train: $incomplete" | tee -a "$OUT/gpu_train.log" >&2
    exit 3
  fi
  PROMPTS="$(mktemp -d)"
  for f in "$GPU"/train/*.jsonl.xz; do
    python3 -c 'import lzma, sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' "$f" \
      > "$PROMPTS/$(basename "$f" .xz)"
  done
  args+=(--target "$GGUF_DIR/target.gguf" --prompts "$PROMPTS"/*.jsonl)
fi
timeout 570 python3 "$ROOT/scripts/gpu_train.py" --out "$OUT" "${args[@]}" 2>&1 | tee -a "$OUT/gpu_train.log"
exit "${PIPESTATUS[0]}"
