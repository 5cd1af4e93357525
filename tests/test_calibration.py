"""Sequential Temperature Scaling and its measures (numpy, synthetic data with a known answer)."""
from __future__ import annotations

import numpy as np
import pytest

from dspark.runtime.tools import sts
from dspark.runtime.sampling import sigmoid

TRUE_T = np.array([2.0, 0.6, 3.0])  # raw scores over-, under- and over-confident


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits [n, γ] and accepted counts [n] from a world where sigmoid(z_k / TRUE_T[k]) is the
    exact probability that slot k survives given that 1..k-1 did."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.5, 2.5, size=(n, len(TRUE_T)))
    survive = rng.random(z.shape) < sigmoid(z / TRUE_T)
    accepted = np.where(survive.all(1), len(TRUE_T), (~survive).argmax(1))
    return z, accepted


def test_measures_on_known_cases():
    y = np.array([0, 0, 1, 1.0])
    assert sts.auc(np.array([0.1, 0.2, 0.3, 0.4]), y) == 1.0
    assert sts.auc(np.array([0.4, 0.3, 0.2, 0.1]), y) == 0.0
    assert sts.auc(np.full(4, 0.5), y) == 0.5  # ties count half
    assert np.isnan(sts.auc(np.ones(4), np.ones(4)))
    p = np.repeat([0.2, 0.8], 10)
    y = np.concatenate([np.r_[np.ones(2), np.zeros(8)], np.r_[np.ones(8), np.zeros(2)]])
    assert sts.ece(p, y, bins=2) == pytest.approx(0.0)  # equal-mass bins, each calibrated
    assert sts.ece(np.full(20, 0.9), y, bins=1) == pytest.approx(0.4)  # one bin: |0.9 - mean(y)|
    assert sts.outcomes(np.array([0, 2, 3]), 3).tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_sts_recovers_known_temperatures():
    z, acc = synthetic(6000, 0)
    temps = sts.fit(z, acc)
    np.testing.assert_allclose(temps, TRUE_T, rtol=0.2)
    z_held, acc_held = synthetic(4000, 1)
    before = sts.report(z_held, acc_held, np.ones(3), boots=50)
    after = sts.report(z_held, acc_held, temps, boots=50)
    for b, a in zip(before, after):
        assert a["ece"] < 0.03 and a["ece"] < b["ece"], (b, a)
        assert a["ece_ci"][0] <= a["ece_ci"][1] and 0.5 < a["auc"] <= 1
    assert after[0]["auc"] == before[0]["auc"]  # one temperature per position keeps the order at position 1


def test_sts_keeps_t_1_where_no_prefix_was_accepted():
    """A position that (almost) no cycle reaches has nothing to fit: t_k stays 1 instead of the
    grid's extreme that predicts 0 everywhere (seen on the shipped drafter's positions 5-7)."""
    z, acc = synthetic(3000, 2)
    acc = np.minimum(acc, 1)  # only position 1 is ever accepted
    temps = sts.fit(z, acc)
    assert temps[1:].tolist() == [1.0, 1.0]
