"""`dspark bench`: the paper's Table 1 and Figure 2 on a bundle's target.

Accepted length τ (dspark.md §1: accepted drafts + the emitted token, per cycle) on the
benchmark prompt sets, at fixed full-block verification (every cycle verifies all γ
drafts, as the paper's offline evaluation does), for one or more bundles that share a
target and differ in their drafter. Reports τ per dataset and temperature, the mean per
domain and the macro-average over domains; the per-position conditional acceptance
P(slot k accepted | slots < k accepted) as a PNG (Figure 2); and, because greedy
decoding of a small model falls into repetition loops that inflate τ, the share of
cycles spent inside one and τ without them. Any JSON Lines file of prompts can be measured
beside (or instead of) the benchmark sets, e.g. training prompts no drafter saw, so that
drafter settings are chosen without looking at the benchmarks.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputError
from .progress import progress
from .prompts import bench_prompts, read_prompt_file

if TYPE_CHECKING:
    from ..engine import Engine

# name -> domain, in the paper's column order
DATASETS = {"gsm8k": "math", "math500": "math", "humaneval": "code", "mbpp": "code",
            "mt-bench": "chat", "arena-hard-v2": "chat"}
DOMAINS = ("math", "code", "chat")
OTHER = "other"  # prompt files that are not benchmark sets
LOOP_WINDOW = 16  # a token is inside a repetition loop when the 16 tokens ending at it occurred before


def load_sets(datasets: Sequence[str], data_dir: Path, files: Sequence[Path], n: int, skip: int = 0
              ) -> dict[str, list[str]]:
    """Set name -> prompts: the benchmark sets `datasets`, then each file of `files` under its
    stem (e.g. held-out training prompts, to compare drafters without touching the benchmarks)."""
    unknown = [d for d in datasets if d not in DATASETS]
    if unknown:
        raise InputError(f"unknown dataset(s) {unknown}; choose from {', '.join(DATASETS)}")
    if n < 1 or skip < 0:
        raise InputError(f"need --prompts >= 1 and --skip >= 0 (got {n}, {skip})")
    sets = {name: bench_prompts(name, n, skip, data_dir) for name in datasets}
    for f in files:
        name = f.name.removesuffix(".jsonl")
        if name in sets:
            raise InputError(f"two prompt sets are named {name!r}; rename the file {f}")
        if not f.is_file():
            raise InputError(f"{f}: no such file")
        sets[name] = read_prompt_file(f, n, skip)
    if not sets:
        raise InputError("no prompt sets: give --datasets or --prompt-file")
    return sets


def domain_of(name: str) -> str:
    """A benchmark set's domain; any other prompt file counts as its own domain, "other"."""
    return DATASETS.get(name, OTHER)


def loop_tokens(token_ids: Sequence[int], window: int = LOOP_WINDOW) -> np.ndarray:
    """[N] bool: token t closes a `window`-gram that already occurred earlier in the output."""
    seen: set[tuple[int, ...]] = set()
    out = np.zeros(len(token_ids), bool)
    for t in range(window - 1, len(token_ids)):
        gram = tuple(token_ids[t - window + 1:t + 1])
        out[t] = gram in seen
        seen.add(gram)
    return out


def loop_cycles(token_ids: Sequence[int], emitted: Sequence[int], window: int = LOOP_WINDOW) -> np.ndarray:
    """[cycles] bool: every token a cycle committed lies inside a repetition loop. Token 0
    comes from the prefill; cycle c committed the next emitted[c] tokens (the last one may
    have been cut by the budget or a stop token)."""
    inside = loop_tokens(token_ids, window)
    ends = np.minimum(1 + np.cumsum(emitted), len(token_ids))  # [cycles]
    starts = np.concatenate([[1], ends[:-1]])
    return np.array([e > s and bool(inside[s:e].all()) for s, e in zip(starts, ends)], bool)


@dataclass
class Cell:
    """Everything measured for one (drafter, temperature, dataset)."""
    prompts: int = 0
    cycles: int = 0
    tokens: int = 0  # emitted by cycles (the prefill's token excluded)
    loop_cycles: int = 0
    loop_tokens: int = 0
    attempts: list[int] = field(default_factory=list)  # [γ]
    accepts: list[int] = field(default_factory=list)  # [γ]

    @property
    def tau(self) -> float:
        return self.tokens / self.cycles if self.cycles else float("nan")

    @property
    def tau_without_loops(self) -> float:
        n = self.cycles - self.loop_cycles
        return (self.tokens - self.loop_tokens) / n if n else float("nan")

    @property
    def loop_share(self) -> float:
        return self.loop_cycles / self.cycles if self.cycles else float("nan")

    def add(self, token_ids: list[int], emitted: list[int], attempts: np.ndarray, accepts: np.ndarray) -> None:
        loops = loop_cycles(token_ids, emitted)
        em = np.asarray(emitted)
        self.prompts += 1
        self.cycles += len(em)
        self.tokens += int(em.sum())
        self.loop_cycles += int(loops.sum())
        self.loop_tokens += int(em[loops].sum())
        self.attempts = [int(x) for x in (attempts + self.attempts if self.attempts else attempts)]
        self.accepts = [int(x) for x in (accepts + self.accepts if self.accepts else accepts)]


def run_cell(engine: "Engine", prompts: Sequence[str], temperature: float, max_new_tokens: int, bar=None) -> Cell:
    cell = Cell()
    for i, prompt in enumerate(prompts):
        r = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=i, scheduler="fixed")
        s = r.stats
        cell.add(r.token_ids, s.emitted, s.attempts, s.accepts)
        if bar is not None:
            bar.update()
    return cell


def domain_means(taus: dict[str, float]) -> dict[str, float]:
    """Mean τ per domain over the datasets present, and 'macro' = the mean of the domain means."""
    out = {}
    for d in (*DOMAINS, OTHER):
        vals = [t for name, t in taus.items() if domain_of(name) == d]
        if vals:
            out[d] = float(np.mean(vals))
    out["macro"] = float(np.mean(list(out.values())))
    return out


def markdown_table(results: dict, datasets: Sequence[str]) -> str:
    doms = [d for d in (*DOMAINS, OTHER) if any(domain_of(n) == d for n in datasets)]
    head = ["drafter", "T", *datasets, *doms, "macro"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, by_temp in results.items():
        for temp, cells in by_temp.items():
            taus = {n: cells[n].tau for n in datasets}
            dm = domain_means(taus)
            row = [label, temp, *(f"{taus[n]:.2f}" for n in datasets), *(f"{dm[d]:.2f}" for d in doms),
                   f"{dm['macro']:.2f}"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


MIN_ATTEMPTS = 10  # positions reached by fewer cycles are left out of Figure 2


def wilson(k: np.ndarray, n: np.ndarray, z: float = 1.96) -> tuple[np.ndarray, np.ndarray]:
    """95 % Wilson score interval of k successes in n trials (elementwise, n > 0)."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def plot_acceptance(results: dict, path: Path) -> None:
    """Figure 2: per-position conditional acceptance pooled over datasets, with 95 % Wilson
    intervals; positions reached by fewer than MIN_ATTEMPTS cycles are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, by_temp) in enumerate(results.items()):
        for j, (temp, cells) in enumerate(by_temp.items()):
            att = np.sum([c.attempts for c in cells.values()], axis=0)  # [γ]
            acc = np.sum([c.accepts for c in cells.values()], axis=0)  # [γ]
            ok = att >= MIN_ATTEMPTS
            if not ok.any():
                continue
            k = np.arange(1, len(att) + 1)[ok] + 0.06 * (2 * i + j - 1.5)  # side by side
            lo, hi = wilson(acc[ok].astype(float), att[ok].astype(float))
            rate = acc[ok] / att[ok]
            ax.errorbar(k, rate, yerr=[rate - lo, hi - rate], marker="o", capsize=3, label=f"{label}, T={temp}")
    gamma = max(len(c.attempts) for by_temp in results.values() for cells in by_temp.values() for c in cells.values())
    ax.set_xticks(range(1, gamma + 1))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Per-position conditional acceptance (95 % Wilson; n >= {MIN_ATTEMPTS})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(bundles: Sequence[str], labels: Sequence[str] | None, datasets: Sequence[str], n_prompts: int,
        temperatures: Sequence[float], max_new_tokens: int, data_dir: Path, out_dir: Path,
        threads: int | None = None, prompt_files: Sequence[Path] = (), skip: int = 0) -> dict:
    if labels and len(labels) != len(bundles):
        raise InputError(f"{len(labels)} --label for {len(bundles)} --bundle")
    from ..engine import Engine

    prompts = load_sets(datasets, data_dir, prompt_files, n_prompts, skip)  # bad files fail before loading
    datasets = list(prompts)
    engines = [Engine.load(b, threads=threads) for b in bundles]
    labels = list(labels) if labels else [e.manifest.name for e in engines]
    bar = progress(len(engines) * len(temperatures) * sum(map(len, prompts.values())), "bench", "prompt")
    results: dict[str, dict[str, dict[str, Cell]]] = {}
    for label, engine in zip(labels, engines):
        results[label] = {f"{t:g}": {name: run_cell(engine, prompts[name], t, max_new_tokens, bar)
                                      for name in datasets} for t in temperatures}
    bar.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "settings": {"bundles": list(bundles), "labels": labels, "datasets": datasets, "prompts": n_prompts,
                     "skip": skip, "prompt_files": [str(f) for f in prompt_files],
                     "temperatures": list(temperatures), "max_new_tokens": max_new_tokens,
                     "scheduler": "fixed (every cycle verifies all γ drafts)", "loop_window": LOOP_WINDOW,
                     "drafters": {lab: e.manifest.drafter_label for lab, e in zip(labels, engines)}},
        "results": {lab: {t: {n: {**asdict(c), "tau": c.tau, "tau_without_loops": c.tau_without_loops,
                                  "loop_share": c.loop_share} for n, c in cells.items()}
                          for t, cells in by_t.items()} for lab, by_t in results.items()},
        "table": markdown_table(results, datasets),
    }
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot_acceptance(results, out_dir / "acceptance.png")
    except ImportError:
        print("matplotlib is not installed: no acceptance.png (pip install matplotlib)", file=sys.stderr)
    return {"report": report, "cells": results}
