#!/usr/bin/env python
"""Where a drafter training step's time goes, on a data directory, with the target's states on the fly.

Builds the trainer exactly as `train_drafter.py train --no-cache [--engine BUNDLE]` does (warm
start from --init-from, --draft-vocab K, 8 sequences x 48 anchors, fp32 on the CPU), runs
--steps steps after one warm-up step, and prints the mean wall time of a step and of its parts:
the batch (the target's states: torch fp32, or the bundle's ONNX Runtime graph with --engine),
the teacher's logits over the draft vocabulary, the backbone, the heads, the losses, the
optimizer; the rest is mostly the backward pass. Each part is timed by wrapping the function
that computes it. Nothing is saved.

    python scripts/bench_train_step.py --data scripts/drafter_data/smollm2 --threads 2 [--engine engines/smollm2]
"""
from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import torch

from dspark.export import load_target
from dspark.export import training as tr
from dspark.export.train_data import record_tokens

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"batch (target states)": "make_batch", "teacher logits": "teacher_vocab_logits",
         "backbone forward": "draft_block_states", "heads forward": "teacher_forced_heads", "losses": "draft_losses"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(ROOT / "scripts" / "drafter_data" / "smollm2"))
    p.add_argument("--engine", default=None, metavar="BUNDLE", help="states from this bundle's graph (default: torch)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    p.add_argument("--init-from", default=str(ROOT / "export" / "drafters" / "smollm2-135m-instruct"))
    p.add_argument("--draft-vocab", type=int, default=8192)
    args = p.parse_args()

    spec = importlib.util.spec_from_file_location("train_drafter", ROOT / "scripts" / "train_drafter.py")
    td = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(td)
    run = Path(tempfile.mkdtemp(prefix="bench_train_step-"))
    argv = ["train", "--data", args.data, "--no-cache", "--run", str(run), "--init-from", args.init_from,
            "--draft-vocab", str(args.draft_vocab), "--anchors", "48", "--threads", str(args.threads)]
    targs = td.build_parser().parse_args(argv + (["--engine", args.engine] if args.engine else []))
    td._threads(args.threads)
    cfg = td._new_config(targs, td._target_config(None), "cpu")
    loaded = load_target(None)
    info = {"data": args.data, "target": None, "engine": args.engine, "cache": None}
    data = td._source(info, loaded.model, cfg, args.threads)
    vocab = td._training_vocab(cfg, loaded, Path(args.data), run)
    trainer = tr.Trainer.start(loaded.model, data, cfg, run, vocab=vocab, device="cpu", save_every=10 ** 9,
                               log_every=10 ** 9)

    spent: dict[str, float] = {}

    def timed(label: str, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
            return out
        return wrapper

    for label, name in PARTS.items():
        setattr(tr, name, timed(label, getattr(tr, name)))
    trainer.optimizer.step = timed("optimizer", trainer.optimizer.step)
    trainer.step()  # warm-up
    spent.clear()
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        tokens += sum(len(record_tokens(data.records[i], cfg.max_seq_len)[0])
                      for i in trainer.plan.indices(trainer.step_idx))
        trainer.step()
    wall = (time.perf_counter() - t0) / args.steps
    print(f"states: {args.engine or 'torch fp32'}, {args.threads} threads, {cfg.batch} sequences x "
          f"{cfg.anchors_per_seq} anchors, {tokens / args.steps:.0f} tokens a step: {wall:.2f} s a step")
    for label, s in spent.items():
        print(f"  {label:24s} {s / args.steps:6.2f} s  {100 * s / args.steps / wall:4.0f} %")
    rest = wall - sum(spent.values()) / args.steps
    print(f"  {'rest (backward, clip)':24s} {rest:6.2f} s  {100 * rest / wall:4.0f} %")


if __name__ == "__main__":
    main()
