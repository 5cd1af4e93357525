"""Sequential Temperature Scaling (dspark.md §4) and the measures it is judged by:
Expected Calibration Error over equal-mass bins and the AUC, per block position. Numpy only.

Data are logged cycles that verified all γ slots: raw confidence logits [N, γ] and the
number of drafts accepted [N]; the outcome of position k is "d_1..d_k all accepted"."""
from __future__ import annotations

import numpy as np

from ..sampling import sigmoid

BINS = 15
GRID = np.geomspace(0.05, 20.0, 241)  # candidate temperatures
MIN_POSITIVES = 20  # a position with fewer accepted prefixes keeps t_k = 1 (no evidence to fit)


def outcomes(accepted: np.ndarray, gamma: int) -> np.ndarray:
    """accepted [N] -> y [N, γ]: y[i, k] = 1 when the first k+1 drafts were accepted."""
    return (accepted[:, None] > np.arange(gamma)).astype(np.float64)


def ece(p: np.ndarray, y: np.ndarray, bins: int = BINS) -> float:
    """Expected Calibration Error of predictions p [N] against outcomes y [N], equal-mass bins."""
    order = np.argsort(p, kind="stable")
    err = 0.0
    for idx in np.array_split(order, min(bins, len(p))):
        err += len(idx) * abs(p[idx].mean() - y[idx].mean())
    return err / len(p)


def auc(p: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half); nan with one class only."""
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(p, return_inverse=True, return_counts=True)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    ranks = (first + (counts + 1) / 2.0)[inverse]  # average 1-based ranks
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def survival(logits: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """logits [N, γ], temperatures [γ] -> a [N, γ]."""
    return np.cumprod(sigmoid(logits / temperatures), axis=1)


def fit(logits: np.ndarray, accepted: np.ndarray, grid: np.ndarray = GRID) -> np.ndarray:
    """Temperatures [γ], fitted left to right: t_k minimises the ECE of a_k with t_1..t_{k-1} fixed.
    Where fewer than MIN_POSITIVES cycles accepted the prefix 1..k, t_k stays 1: the ECE would
    otherwise be minimised by the grid's extreme that predicts 0 everywhere."""
    gamma = logits.shape[1]
    y = outcomes(accepted, gamma)
    temps = np.ones(gamma)
    prefix = np.ones(len(logits))  # a_{k-1}
    for k in range(gamma):
        if y[:, k].sum() < MIN_POSITIVES:
            prefix = prefix * sigmoid(logits[:, k])
            continue
        errs = [ece(prefix * sigmoid(logits[:, k] / t), y[:, k]) for t in grid]
        temps[k] = grid[int(np.argmin(errs))]
        prefix = prefix * sigmoid(logits[:, k] / temps[k])
    return temps


def report(logits: np.ndarray, accepted: np.ndarray, temperatures: np.ndarray, boots: int = 200,
           seed: int = 0) -> list[dict]:
    """Per position: ECE and AUC of a_k with `temperatures`, each with a 95 % bootstrap interval
    (cycles resampled with replacement)."""
    gamma = logits.shape[1]
    a, y = survival(logits, temperatures), outcomes(accepted, gamma)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(boots, len(a)))  # [boots, N]
    rows = []
    for k in range(gamma):
        e = [ece(a[i, k], y[i, k]) for i in idx]
        u = [auc(a[i, k], y[i, k]) for i in idx]
        rows.append({"position": k + 1, "ece": ece(a[:, k], y[:, k]), "ece_ci": np.percentile(e, [2.5, 97.5]).tolist(),
                     "auc": auc(a[:, k], y[:, k]), "auc_ci": np.nanpercentile(u, [2.5, 97.5]).tolist()
                     if not np.all(np.isnan(u)) else [float("nan")] * 2,
                     "rate": float(y[:, k].mean()), "n": len(a)})
    return rows
