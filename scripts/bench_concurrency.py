#!/usr/bin/env python
"""Concurrency benchmark: total and per-request tokens/s against the number of requests
served at once, R ∈ {1, 2, 4, 8, 16, 32}, for

  none   the target alone on the bundle's engine
  fixed  DSpark verifying all γ drafts
  auto   DSpark with the default scheduler (Algorithm 1 with the drafter's cost and the drafter
         gate, `cost`, when the bundle has sps.json and calibration.json from `dspark profile`
         and `dspark calibrate`; else `fixed`, with a warning)

side by side, greedy, over GSM8K and MT-Bench prompts (first turn). Each R level serves
2·R requests (at least --min-requests) through R slots, so requests join and leave;
the contenders run one after the other on the same engine after a warm-up, in --rounds
rounds of alternating order (A B C, C B A, ...) so that a drift of a shared machine's speed
falls on all of them (an even number of rounds gives every contender each position equally
often); tokens/s pools the rounds, and each level prints the per-round ratios and every
contender's wall split into the seconds inside the engine's calls (prefill, target, drafter)
(inside the engine's runs, from its timing hook) and the loop's rest. Greedy outputs at R > 1 are compared with the same scheduler's R = 1
outputs.

    python scripts/bench_concurrency.py --bundle engines/smollm2 --out /tmp/conc.json --png /tmp/conc.png

This is a benchmark, not a test: it prints figures, it asserts nothing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import numpy as np

from dspark.runtime import Engine
from dspark.runtime.backends import RunTimer
from dspark.runtime.tools.prompts import bench_prompts

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ("gsm8k", "mt-bench")


def load_prompts(data_dir: Path, n: int) -> list[str]:
    """n prompts, alternating between the datasets (first turns)."""
    per = [bench_prompts(name, n, data_dir=data_dir / "bench") for name in DATASETS]
    mixed = [p for pair in zip(*per) for p in pair][:n]
    if len(mixed) < n:
        raise SystemExit(f"only {len(mixed)} prompts in {data_dir / 'bench'}, {n} needed")
    return mixed


KINDS = ("prefill", "target", "drafter")  # the engine runs the timing hook reports


def run_level(engine: Engine, prompts: list[str], scheduler: str, max_new_tokens: int) -> dict:
    """One pass of `prompts` through the engine's slots under `scheduler` (after a warm-up)."""
    engine.generate_batch(prompts[:engine.backend.slots], max_new_tokens=8, scheduler=scheduler)  # warm-up
    timer = engine.backend.on_run = RunTimer()
    try:
        t0 = time.perf_counter()
        results = engine.generate_batch(prompts, max_new_tokens=max_new_tokens, scheduler=scheduler)
        wall = time.perf_counter() - t0
    finally:
        engine.backend.on_run = None
    return {"wall_s": wall, "results": results, "call_s": {k: timer.seconds[k] for k in KINDS}}


def summarize(engine: Engine, scheduler: str, runs: list[dict]) -> dict:
    """Figures of one contender at one level, pooled over its rounds (tokens/s = Σ tokens / Σ wall)."""
    results = [r for run in runs for r in run["results"]]
    tokens = [len(r.token_ids) for r in results]
    stats = [r.stats for r in results if r.stats.verified]
    return {
        "scheduler": scheduler, "resolved": getattr(engine.scheduler(scheduler), "name", "none"),
        "requests": len(runs[0]["results"]), "rounds": len(runs), "tokens": int(sum(tokens)),
        "wall_s": sum(run["wall_s"] for run in runs),
        "call_s": {k: sum(run["call_s"][k] for run in runs) for k in KINDS},
        "total_tok_s": sum(tokens) / sum(run["wall_s"] for run in runs),
        "round_total_tok_s": [sum(len(r.token_ids) for r in run["results"]) / run["wall_s"] for run in runs],
        "per_request_tok_s": float(np.mean([r.stats.to_dict(n)["tokens_per_s"] for r, n in zip(results, tokens)])),
        "tau": float(np.mean([s.tau for s in stats])) if stats else 1.0,
        "mean_verified": float(np.mean([v for s in stats for v in s.verified])) if stats else 0.0,
        "drafted_share": float(sum(sum(s.drafted) for s in stats) / max(1, sum(s.cycles for s in stats))),
        "mean_batch": float(np.mean([b for r in results for b in r.stats.batch])),
        "token_ids": [r.token_ids for r in runs[0]["results"]],
    }


def plot(levels: dict[int, dict[str, dict]], path: Path) -> None:
    """Total throughput against per-request speed (each point an R), and the mean verified
    length against R."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    Rs = sorted(levels)
    for name in levels[Rs[0]]:
        label = f"{name} ({levels[Rs[0]][name]['resolved']})"
        x = [levels[R][name]["per_request_tok_s"] for R in Rs]
        y = [levels[R][name]["total_tok_s"] for R in Rs]
        ax1.plot(x, y, "o-", ms=4, label=label)
        for R, xi, yi in zip(Rs, x, y):
            ax1.annotate(f"R={R}", (xi, yi), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax2.plot(Rs, [levels[R][name]["mean_verified"] for R in Rs], "o-", ms=4, label=label)
    ax1.set(xlabel="per-request tokens/s", ylabel="total tokens/s", title="throughput against per-request speed")
    ax2.set(xlabel="concurrent requests R", ylabel="mean verified length ℓ", title="mean verified length",
            xscale="log", xticks=Rs, xticklabels=[str(r) for r in Rs])
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=ROOT / "engines" / "smollm2", help="bundle (default engines/smollm2)")
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data", help="has bench/*.jsonl")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="R levels (default 1,2,4,8,16,32)")
    p.add_argument("--schedulers", default="none,fixed,auto", help="contenders (default none,fixed,auto)")
    p.add_argument("--min-requests", type=int, default=8, help="requests per level at least (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--rounds", type=int, default=2, help="runs of every contender per level, in alternating "
                   "order (default 2: A B C then C B A); tokens/s pools them")
    p.add_argument("--max-seq", type=int, default=1024, help="KV positions per slot (default 1024)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="ONNX Runtime threads")
    p.add_argument("--out", type=Path, default=None, help="write every figure to this JSON file")
    p.add_argument("--png", type=Path, default=None, help="write the plots to this PNG file")
    args = p.parse_args(argv)

    Rs = [int(r) for r in args.concurrency.split(",")]
    schedulers = args.schedulers.split(",")
    prompts = load_prompts(args.data_dir, max(max(2 * R for R in Rs), args.min_requests))
    levels: dict[int, dict[str, dict]] = {}
    print(f"{'R':>3} {'scheduler':>10} {'total tok/s':>12} {'per-req tok/s':>14} {'τ':>5} {'ℓ':>5} {'batch':>6} "
          f"{'identical to R=1':>17}")
    for R in Rs:
        engine = Engine.load(args.bundle, max_seq=args.max_seq, slots=R, threads=args.threads)
        n = max(2 * R, args.min_requests)
        runs: dict[str, list[dict]] = {name: [] for name in schedulers}
        for k in range(args.rounds):  # A B C, then C B A, ...: a drift of the machine hits every contender
            for name in (schedulers if k % 2 == 0 else schedulers[::-1]):
                runs[name].append(run_level(engine, prompts[:n], name, args.max_new_tokens))
        levels[R] = {}
        for name in schedulers:
            level = summarize(engine, name, runs[name])
            base = levels[Rs[0]][name]["token_ids"] if R != Rs[0] else level["token_ids"]
            level["identical_to_first_level"] = sum(a == b for a, b in zip(base, level["token_ids"]))
            levels[R][name] = level
            compared = min(len(base), len(level["token_ids"]))
            print(f"{R:>3} {name + ('' if level['resolved'] == name else '→' + level['resolved']):>10} "
                  f"{level['total_tok_s']:>12.1f} {level['per_request_tok_s']:>14.1f} {level['tau']:>5.2f} "
                  f"{level['mean_verified']:>5.2f} {level['mean_batch']:>6.1f} "
                  f"{level['identical_to_first_level']:>8}/{compared}", flush=True)
        baselines = [name for name in ("none", "fixed") if name in levels[R]]
        if baselines:
            best = max(baselines, key=lambda name: levels[R][name]["total_tok_s"])
            print(f"    total tok/s / best of ({', '.join(baselines)}) = {best} [per round]: " + ", ".join(
                f"{name} {lv['total_tok_s'] / levels[R][best]['total_tok_s']:.3f}x ["
                + " ".join(f"{a / b:.2f}" for a, b in zip(lv["round_total_tok_s"], levels[R][best]["round_total_tok_s"]))
                + "]" for name, lv in levels[R].items() if name not in baselines), flush=True)
        for name, lv in levels[R].items():
            calls = lv["call_s"]
            print(f"    {name} wall {lv['wall_s']:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in calls.items())
                  + f", loop {lv['wall_s'] - sum(calls.values()):.2f}", flush=True)
        del engine
    if args.png:
        plot(levels, args.png)
        print(f"wrote {args.png}")
    if args.out:
        args.out.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                        "bundle": str(args.bundle), "args": {k: str(v) for k, v in vars(args).items()},
                                        "levels": levels}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
