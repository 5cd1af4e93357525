"""`dspark calibrate --bundle DIR`: Sequential Temperature Scaling of the confidence head
(dspark.md §4) on cycles logged on training prompts, stored as the bundle's calibration.json.

Prompts come from ../shared/data/train only (never bench). They are split, by prompt, into
a fitting half and a disjoint held-out half; the engine decodes them verifying all γ drafts
(so every position's outcome is observed), the temperatures are fitted on the fitting
cycles, and ECE / AUC per position are reported on the held-out cycles, before and after,
with 95 % bootstrap intervals. A reliability diagram is written next to the table."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..calibration import CALIBRATION_FILE, Calibration
from ..engine import Engine
from ..errors import InputError
from . import sts
from .plots import pyplot
from .progress import progress
from .prompts import load_train_prompts

MIN_CYCLES = 20
CHUNK_SLOTS = 8  # prompts per generate_batch call, in units of the slot count


@dataclass(frozen=True)
class CalibrateConfig:
    prompts: int = 200  # prompts decoded, fitting and held-out halves together
    holdout: float = 0.5  # the held-out share
    max_new_tokens: int = 128
    temperature: float = 1.0  # the confidence head is trained at T = 1
    slots: int = 4  # requests decoded at once
    seed: int = 0
    boots: int = 200  # bootstrap resamples for the intervals


def log_cycles(engine: Engine, prompts: list[str], cfg: CalibrateConfig, bar) -> tuple[np.ndarray, np.ndarray]:
    """Decode with every draft verified -> raw confidence logits [N, γ], drafts accepted [N]
    (cycles whose ℓ the token budget cut below γ are left out). Prompts go in chunks of
    CHUNK_SLOTS·slots so that `bar` moves; requests still join and leave within a chunk."""
    gamma = engine.manifest.drafter.block_size
    logits, accepted = [], []
    chunk = CHUNK_SLOTS * cfg.slots
    for lo in range(0, len(prompts), chunk):
        part = prompts[lo:lo + chunk]
        results = engine.generate_batch(part, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                        seeds=[cfg.seed + lo + i for i in range(len(part))], scheduler="fixed")
        for r in results:
            for conf, ell, emitted in zip(r.stats.confidences, r.stats.verified, r.stats.emitted):
                if ell == gamma:
                    logits.append(conf)
                    accepted.append(emitted - 1)
        bar.update(len(part))
    return np.array(logits, np.float64).reshape(-1, gamma), np.array(accepted, np.int64)


def calibrate(bundle: str | Path, cfg: CalibrateConfig, data: list[str] | None = None, png: str | Path | None = None,
              **engine_kwargs) -> dict:
    bundle = Path(bundle)
    if not 0 < cfg.holdout < 1 or cfg.prompts < 2:
        raise InputError(f"need prompts >= 2 and 0 < holdout < 1 (got {cfg.prompts}, {cfg.holdout})")
    engine = Engine.load(bundle, slots=cfg.slots, read_tables=False, **engine_kwargs)
    room = engine.backend.max_seq - cfg.max_new_tokens - engine.manifest.drafter.block_size - 1
    pool = [p.text for p in load_train_prompts(data)]
    order = [i for i in np.random.default_rng(cfg.seed).permutation(len(pool))
             if len(engine.encode(pool[i])) <= room][:cfg.prompts]  # prompts that fit the context
    n_held = max(1, min(len(order) - 1, round(cfg.holdout * len(order))))
    held = [pool[i] for i in order[:n_held]]
    fit = [pool[i] for i in order[n_held:]]  # disjoint by construction (pool is de-duplicated)
    bar = progress(len(order), "calibrate", "prompt")
    x_fit, y_fit = log_cycles(engine, fit, cfg, bar)
    x_held, y_held = log_cycles(engine, held, cfg, bar)
    bar.close()
    if min(len(x_fit), len(x_held)) < MIN_CYCLES:
        raise InputError(f"only {len(x_fit)} fitting and {len(x_held)} held-out cycles verified all drafts "
                         f"(need {MIN_CYCLES} each): raise --prompts or --max-new-tokens")
    temps = sts.fit(x_fit, y_fit)
    before = sts.report(x_held, y_held, np.ones_like(temps), cfg.boots, cfg.seed)
    after = sts.report(x_held, y_held, temps, cfg.boots, cfg.seed)
    summary = {"temperatures": temps.tolist(), "before": before, "after": after,
               "fit_prompts": len(fit), "held_out_prompts": len(held), "fit_cycles": len(x_fit),
               "held_out_cycles": len(x_held), "sampling_temperature": cfg.temperature,
               "max_new_tokens": cfg.max_new_tokens, "data": data or "../shared/data/train",
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    Calibration(tuple(float(t) for t in temps)).save(bundle, summary)
    summary["png"] = str(reliability_diagram(x_held, y_held, temps, Path(png or bundle / "calibration.png")))
    summary["file"] = str(bundle / CALIBRATION_FILE)
    return summary


def reliability_diagram(logits: np.ndarray, accepted: np.ndarray, temps: np.ndarray, path: Path) -> Path:
    """Per position: observed prefix acceptance against predicted a_k (equal-mass bins), raw and calibrated."""
    plt = pyplot()
    gamma = logits.shape[1]
    y = sts.outcomes(accepted, gamma)
    fig, axes = plt.subplots(1, gamma, figsize=(2.6 * gamma, 2.8), squeeze=False)
    for k, ax in enumerate(axes[0]):
        top = 0.0  # the axes end just past the largest bin mean: deep positions live near 0
        for t, label, style in ((np.ones_like(temps), "raw", "o--"), (temps, "STS", "s-")):
            a = sts.survival(logits, t)[:, k]
            bins = np.array_split(np.argsort(a, kind="stable"), min(sts.BINS, len(a)))
            xs, ys = [a[b].mean() for b in bins], [y[b, k].mean() for b in bins]
            top = max(top, *xs, *ys)
            ax.plot(xs, ys, style, ms=3, label=f"{label} ECE {sts.ece(a, y[:, k]):.4f}")
        lim = min(1.0, max(0.01, 1.1 * top))
        ax.plot([0, lim], [0, lim], color="grey", lw=0.8)
        ax.set(title=f"position {k + 1} (P = {y[:, k].mean():.3f})", xlabel="predicted a_k", xlim=(0, lim),
               ylim=(0, lim))
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("observed prefix accepted")
    fig.suptitle("reliability (held-out cycles)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_report(summary: dict) -> str:
    def ci(row: dict, key: str) -> str:
        lo, hi = row[f"{key}_ci"]
        return f"{row[key]:.3f} [{lo:.3f}, {hi:.3f}]"

    lines = [f"held-out: {summary['held_out_cycles']} cycles from {summary['held_out_prompts']} prompts; fitted on "
             f"{summary['fit_cycles']} cycles from {summary['fit_prompts']} other prompts (95 % bootstrap intervals)",
             f"{'k':>2} {'P(prefix)':>9} {'t_k':>6}  {'ECE raw':>22} {'ECE STS':>22} {'AUC raw':>22} {'AUC STS':>22}"]
    for b, a, t in zip(summary["before"], summary["after"], summary["temperatures"]):
        lines.append(f"{b['position']:>2} {b['rate']:>9.3f} {t:>6.3f}  {ci(b, 'ece'):>22} {ci(a, 'ece'):>22} "
                     f"{ci(b, 'auc'):>22} {ci(a, 'auc'):>22}")
    lines.append(f"wrote {summary['file']} and {summary['png']}")
    return "\n".join(lines)
