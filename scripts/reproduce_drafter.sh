#!/usr/bin/env bash
# Reproduce the shipped default drafter (export/drafters/smollm2-135m-instruct) and its DFlash
# ablation from scratch on a 2-core CPU, then Table 1 / Figure 2. Every step is resumable:
# rerun the script and each step continues where it stopped.
#
#   bash scripts/reproduce_drafter.sh            # everything (hours on a small CPU; docs/drafter.md has the wall times)
#   TRAIN_MINUTES=30 bash scripts/reproduce_drafter.sh
#
# Training has four phases, as the shipped drafter had (four sessions): phase 1 from a random
# init (a 1000-step schedule that the first session's budget stopped at step 866 for DSpark
# and 908 for DFlash: --max-steps reproduces that), phase 2 a warm start from phase 1's fp32
# weights with a fresh schedule (1700 steps, lr 5e-4, seed 1), phase 3 a warm start from
# phase 2's on 1,800 more sequences (1,493 steps, lr 4e-4, seed 2), phase 4 a warm start from
# phase 3's on 1,700 more GSM8K sequences (a 1,153-step schedule, lr 4e-4, seed 3, that the
# session's budget stopped at step 1,146 for DSpark). A held-out set
# (prompts no phase trained on) measures the drafters teacher-forced at the end.
#
# Wall time of the shipped run and every figure: docs/drafter.md and docs/results.md.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${DATA:-out/drafter/data}
RUN=${RUN:-out/drafter/run-dspark}
RUN_DFLASH=${RUN_DFLASH:-out/drafter/run-dflash}
INIT=out/drafter/init-dspark INIT_DFLASH=out/drafter/init-dflash  # phase 1's fp32 weights
RUN2=out/drafter/run2-dspark RUN2_DFLASH=out/drafter/run2-dflash  # phase 2
INIT3=out/drafter/init3-dspark INIT3_DFLASH=out/drafter/init3-dflash  # phase 2's fp32 weights
RUN3=out/drafter/run3-dspark RUN3_DFLASH=out/drafter/run3-dflash  # phase 3
INIT4=out/drafter/init4-dspark INIT4_DFLASH=out/drafter/init4-dflash  # phase 3's fp32 weights
RUN4=out/drafter/run4-dspark RUN4_DFLASH=out/drafter/run4-dflash  # phase 4
HELDOUT=out/drafter/heldout
TRAIN_MINUTES=${TRAIN_MINUTES:-100}  # a session's budget; rerun the script to continue a run later
LAYERS="1 8 15 22 28"
ARCH=(--data "$DATA" --layers 2 --layer-ids $LAYERS --anchors 48 --batch 8 --amp bf16)
PHASE1=(--steps 1000 --warmup 50 --lr 1e-3 --seed 0)
PHASE2=(--steps 1700 --warmup 30 --lr 5e-4 --seed 1)
STEPS3=1493  # phase 3's length in the shipped run (docs/drafter.md)
PHASE3=(--steps $STEPS3 --warmup 30 --lr 4e-4 --seed 2)
STEPS4=1153  # what the fourth session's time allowed (DSpark's run stopped at step 1146 of them)
PHASE4=(--steps $STEPS4 --warmup 30 --lr 4e-4 --seed 3)
SESSION=(--threads 1 --save-every 50 --log-every 5 --time-budget "${TRAIN_MINUTES}m")

GEN=(--max-new-tokens 256 --batch 32 --threads 2)
CACHE=(--layer-ids $LAYERS --dtype bf16 --batch 8 --threads 2)
# 1. responses by the target itself (bf16, batch 32, at most 256 new tokens), 150 self-written
#    chat/code requests first: at T = 0 for 500 GSM8K-train questions + 175 alpaca tasks + the
#    150, at T = 1 for the first 250 of the GSM8K questions + the same 325 (phases 1 and 2 train
#    on these 1,400 only: a run resumes only on the data it started with, so the growth for
#    phase 3 waits until phase 2 is done)
python scripts/train_drafter.py generate --data "$DATA" --limit 500 --self-prompts 150 --temperatures 0 "${GEN[@]}"
python scripts/train_drafter.py generate --data "$DATA" --limit 250 --self-prompts 150 --temperatures 1 "${GEN[@]}"
# 2. the target's features at the drafter's layers + its final hidden state (fp16 on disk, bf16 matmuls)
python scripts/train_drafter.py cache --data "$DATA" "${CACHE[@]}"
# 3. DSpark and the DFlash ablation side by side, one core each, same data, schedule and seed
steps_done() {  # run-dir -> the latest checkpoint's step (0 if none)
    local last; last=$(ls "$1/checkpoints" 2>/dev/null | tail -1)
    last=${last#step-}; echo $((10#${last:-0}))
}
train() {  # run-dir, stop step, train flags...: train (or resume) the run until its stop step
    local run=$1 stop=$2; shift 2
    local done; done=$(steps_done "$run")
    if [ "$done" -ge "$stop" ]; then return 0; fi
    if [ "$done" -gt 0 ]; then
        python scripts/train_drafter.py resume --run "$run" "${SESSION[@]}" --max-steps $((stop - done))
    else
        python scripts/train_drafter.py train --run "$run" "${ARCH[@]}" "$@" "${SESSION[@]}" --max-steps "$stop"
    fi
}
reached() {  # run, stop step, run, stop step: stop here unless both runs reached their stop steps
    if [ "$(steps_done "$1")" -lt "$2" ] || [ "$(steps_done "$3")" -lt "$4" ]; then
        echo "training stopped before steps $2/$4 (the session budget, or an error: see $1.log and $3.log);" \
             "rerun this script to continue" >&2
        exit 3
    fi
}
train "$RUN" 866 "${PHASE1[@]}" >> "$RUN.log" 2>&1 &  # phase 1
train "$RUN_DFLASH" 908 "${PHASE1[@]}" --dflash >> "$RUN_DFLASH.log" 2>&1 &
wait
reached "$RUN" 866 "$RUN_DFLASH" 908
grow() {  # T = 0 limit, T = 1 limit: answer more training prompts (350 self-written requests in all), cache them
    python scripts/train_drafter.py generate --data "$DATA" --limit "$1" --self-prompts 350 --temperatures 0 "${GEN[@]}"
    python scripts/train_drafter.py generate --data "$DATA" --limit "$2" --self-prompts 350 --temperatures 1 "${GEN[@]}"
    python scripts/train_drafter.py cache --data "$DATA" "${CACHE[@]}"
}
warm_phase() {  # previous runs, their fp32 exports, new runs, stop steps, phase flags...: warm-start both drafters
    local prev=$1 prev_dflash=$2 init=$3 init_dflash=$4 run=$5 run_dflash=$6 stop=$7 stop_dflash=$8; shift 8
    [ -e "$init" ] || python scripts/train_drafter.py export --run "$prev" --out "$init" --dtype fp32
    [ -e "$init_dflash" ] || python scripts/train_drafter.py export --run "$prev_dflash" --out "$init_dflash" --dtype fp32
    train "$run" "$stop" "$@" --init-from "$init" >> "$run.log" 2>&1 &
    train "$run_dflash" "$stop_dflash" "$@" --dflash --init-from "$init_dflash" >> "$run_dflash.log" 2>&1 &
    wait
    reached "$run" "$stop" "$run_dflash" "$stop_dflash"
}
# phase 2: a warm start from phase 1's fp32 weights on the same data
warm_phase "$RUN" "$RUN_DFLASH" "$INIT" "$INIT_DFLASH" "$RUN2" "$RUN2_DFLASH" 1700 1700 "${PHASE2[@]}"
# phase 3: 800 more GSM8K questions and 200 more self-written requests at T = 0, 600 more GSM8K
# questions at T = 1 (3,200 sequences in all), then a warm start from phase 2's fp32 weights
grow 1300 850
warm_phase "$RUN2" "$RUN2_DFLASH" "$INIT3" "$INIT3_DFLASH" "$RUN3" "$RUN3_DFLASH" $STEPS3 $STEPS3 "${PHASE3[@]}"
# phase 4: the next 1,000 GSM8K questions at T = 0 and 700 at T = 1 (4,900 sequences in all),
# then a warm start from phase 3's fp32 weights
grow 2300 1550
warm_phase "$RUN3" "$RUN3_DFLASH" "$INIT4" "$INIT4_DFLASH" "$RUN4" "$RUN4_DFLASH" 1146 $STEPS4 "${PHASE4[@]}"
# 4. the shippable bf16 checkpoints (no embeddings: restored from the target at load) with the
#    training responses' token counts (token_counts.json, for `dspark export --draft-vocab`)
python scripts/train_drafter.py export --run "$RUN4" --out export/drafters/smollm2-135m-instruct
python scripts/train_drafter.py export --run "$RUN4_DFLASH" --out out/drafter/smollm2-dflash
# 5. bundles (the others reuse the default bundle's target graphs) and Table 1 / Figure 2: both
#    drafters over the whole vocabulary, and the default bundle (8,192-token draft vocabulary)
dspark export --out engines/smollm2 --draft-vocab 8192
dspark export --drafter export/drafters/smollm2-135m-instruct --out engines/smollm2-full --reuse-target engines/smollm2
dspark export --drafter out/drafter/smollm2-dflash --out engines/smollm2-dflash --reuse-target engines/smollm2
dspark bench --bundle engines/smollm2-full --label DSpark --bundle engines/smollm2-dflash --label DFlash \
    --bundle engines/smollm2 --label "DSpark 8K" --prompts 8 --max-new-tokens 160 --threads 1 --out out/bench
# 6. the held-out set: the last 100 GSM8K-train questions and 40 new self-written requests, none
#    in $DATA, at T = 0 and 1; every phase's drafters teacher-forced on it and on 280 of the
#    first 1,400 training sequences
python scripts/train_drafter.py generate --data "$HELDOUT" --skip 7373 --self-prompts 40 --seed 7 \
    --disjoint-from "$DATA" --temperatures 0 1 "${GEN[@]}"
python scripts/train_drafter.py cache --data "$HELDOUT" "${CACHE[@]}"
EVAL=(python scripts/train_drafter.py evaluate --threads 2 --drafter "$INIT" "$INIT3" "$INIT4" "$RUN4" "$INIT_DFLASH"
      "$INIT3_DFLASH" "$INIT4_DFLASH" "$RUN4_DFLASH" --label dspark-p1 dspark-p2 dspark-p3 dspark-p4 dflash-p1
      dflash-p2 dflash-p3 dflash-p4)
"${EVAL[@]}" --cache "$HELDOUT/features-${LAYERS// /_}"
"${EVAL[@]}" --cache "$DATA/features-${LAYERS// /_}" --first 1400 --sequences 280  # trained on by every phase
