"""The acceptance rule vectorized over rows (`sampling.accept`, what every backend runs, on the
host with numpy or next to a device's logits with CuPy): a batch of mixed greedy and sampled rows
of different lengths, right-padded, gives every row exactly what it gets alone, for blocks of
every length, rejections, full acceptance and a residual below the floor."""
import numpy as np
import pytest
from rules import softmax, verify

from dspark.runtime.sampling import accept, inverse_cdf, sample


def case(rng, ell, V, temperature, agree):
    logits = rng.standard_normal((ell + 1, V)) * 3
    draft_logits = logits[:ell] + agree * rng.standard_normal((ell, V))
    if temperature == 0:
        p_d = np.eye(V, dtype=np.float32)[draft_logits.argmax(-1)]
        drafts = draft_logits.argmax(-1)
    else:
        p_d = softmax(draft_logits, temperature).astype(np.float32)
        drafts = np.array([rng.choice(V, p=p / p.sum()) for p in p_d.astype(np.float64)], np.int64)
    return drafts.astype(np.int64), p_d, logits.astype(np.float32), rng.random(ell), float(rng.random())


def test_a_batch_of_rows_equals_each_row_alone():
    rng = np.random.default_rng(0)
    V, gamma = 11, 7
    seen = set()
    for trial in range(60):
        B = int(rng.integers(1, 6))
        temps = rng.choice([0.0, 0.7, 1.0], size=B)
        rows = [case(rng, int(rng.integers(0, gamma + 1)), V, t, agree=[0.0, 0.3, 3.0][trial % 3]) for t in temps]
        S = 1 + max(len(r[0]) for r in rows)
        drafts, p_d = np.zeros((B, S - 1), np.int64), np.zeros((B, gamma, V), np.float32)
        logits = rng.standard_normal((B, S, V)).astype(np.float32)  # padding rows hold noise: never read
        u = np.zeros((B, gamma + 1))
        for b, (d, q, z, ua, ue) in enumerate(rows):
            n = len(d)
            drafts[b, :n], p_d[b, :n], logits[b, :n + 1], u[b, :n], u[b, gamma] = d, q, z, ua, ue
        lengths = np.array([len(r[0]) for r in rows])
        a, tokens = accept(np, drafts, lengths, p_d, logits, temps, u)
        for b, (d, q, z, ua, ue) in enumerate(rows):
            want = verify(d, q, z, float(temps[b]), ua, ue)
            assert (int(a[b]), int(tokens[b])) == want, (trial, b)
            seen.add(want[0] == len(d))
    assert seen == {True, False}, "both rejections and full acceptance must occur"


def test_greedy_rows_need_no_distributions():
    logits = np.array([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]]], np.float32)  # argmax 1, 0, 2
    a, tokens = accept(np, np.array([[1, 0]]), np.array([2]), None, logits, np.array([0.0]), np.zeros((1, 3)))
    assert (int(a[0]), int(tokens[0])) == (2, 2)
    a, tokens = accept(np, np.array([[1, 2]]), np.array([2]), None, logits, np.array([0.0]), np.zeros((1, 3)))
    assert (int(a[0]), int(tokens[0])) == (1, 0)


def test_residual_below_the_floor_draws_from_the_target():
    p_t_logits = np.log(np.array([[0.5, 0.5, 1e-30], [0.2, 0.3, 0.5]]))
    p_d = np.array([[0.5, 0.5, 0.0]], np.float32)  # p_d == p_t: residual mass 0
    drafts = np.array([2], np.int64)  # p_t(2) ~ 0: rejected
    for ue, tok in ((0.1, 0), (0.7, 1)):
        assert verify(drafts, p_d, p_t_logits, 1.0, np.array([0.5]), ue) == (0, tok)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_rows(temperature):
    rng = np.random.default_rng(1)
    z = rng.standard_normal((5, 9))
    u = rng.random(5)
    got = sample(np, z, np.full(5, temperature), u)
    want = z.argmax(-1) if temperature == 0 else [inverse_cdf(softmax(z[b], temperature), u[b]) for b in range(5)]
    assert got.tolist() == list(map(int, want))


def test_inverse_cdf_on_torch_tensors():
    torch = pytest.importorskip("torch")
    p = np.array([[0.125, 0.25, 0.125, 0.5], [0.0, 0.5, 0.0, 0.5]])
    u = np.array([0.3749, 0.5])
    assert inverse_cdf(torch.tensor(p), torch.tensor(u)).tolist() == inverse_cdf(p, u).tolist() == [1, 3]
