#!/usr/bin/env bash
# Reproduce the shipped default drafter (export/drafters/smollm2-135m-instruct) and its DFlash
# ablation from scratch on a 2-core CPU, then Table 1 / Figure 2. Every step is resumable:
# rerun the script and each step continues where it stopped.
#
#   bash scripts/reproduce_drafter.sh            # everything (about 2.5 hours on a 2-core VM;
#                                                # the shipped run stopped at step 866 of 1000)
#   TRAIN_MINUTES=30 bash scripts/reproduce_drafter.sh
#
# Wall time of the shipped run and every figure: README.md, "The default drafter".
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${DATA:-out/drafter/data}
RUN=${RUN:-out/drafter/run-dspark}
RUN_DFLASH=${RUN_DFLASH:-out/drafter/run-dflash}
STEPS=${STEPS:-1000}                # optimisation steps of both runs (the cosine schedule's length)
TRAIN_MINUTES=${TRAIN_MINUTES:-64}  # a session's budget; `resume` continues a run later
LAYERS="1 8 15 22 28"
COMMON=(--data "$DATA" --layers 2 --layer-ids $LAYERS --anchors 48 --batch 8 --steps "$STEPS" --warmup 50
        --lr 1e-3 --amp bf16 --threads 1 --save-every 50 --log-every 5 --time-budget "${TRAIN_MINUTES}m")

# 1. responses by the target itself (bf16, batch 32, at most 256 new tokens), 150 self-written
#    chat/code requests first: at T = 0 for 500 GSM8K-train questions + 175 alpaca tasks + the
#    150, at T = 1 for the first 250 of the GSM8K questions + the same 325
python scripts/train_drafter.py generate --data "$DATA" --limit 500 --self-prompts 150 --temperatures 0 \
    --max-new-tokens 256 --batch 32 --threads 2
python scripts/train_drafter.py generate --data "$DATA" --limit 250 --self-prompts 150 --temperatures 1 \
    --max-new-tokens 256 --batch 32 --threads 2
# 2. the target's features at the drafter's layers + its final hidden state (fp16 on disk, bf16 matmuls)
python scripts/train_drafter.py cache --data "$DATA" --layer-ids $LAYERS --dtype bf16 --batch 8 --threads 2
# 3. DSpark and the DFlash ablation side by side, one core each, same data, steps and seed
train() {  # run-dir, extra flags...
    local run=$1; shift
    if [ -e "$run/checkpoints" ]; then
        python scripts/train_drafter.py resume --run "$run" --threads 1 --save-every 50 --log-every 5 --time-budget "${TRAIN_MINUTES}m"
    else
        python scripts/train_drafter.py train --run "$run" "${COMMON[@]}" "$@"
    fi
}
train "$RUN" > "$RUN.log" 2>&1 &
train "$RUN_DFLASH" --dflash > "$RUN_DFLASH.log" 2>&1 &
wait
# 4. the shippable bf16 checkpoints (no embeddings: restored from the target at load)
python scripts/train_drafter.py export --run "$RUN" --out export/drafters/smollm2-135m-instruct
python scripts/train_drafter.py export --run "$RUN_DFLASH" --out out/drafter/smollm2-dflash
# 5. bundles (the DFlash one reuses the default bundle's target graphs) and Table 1 / Figure 2
dspark export --out engines/smollm2
dspark export --drafter out/drafter/smollm2-dflash --out engines/smollm2-dflash --reuse-target engines/smollm2
dspark bench --bundle engines/smollm2 --label DSpark --bundle engines/smollm2-dflash --label DFlash --out out/bench
