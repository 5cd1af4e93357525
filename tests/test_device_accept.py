"""The branch-free acceptance rule (runtime/gpu/accept.py, run by GPU backends on the device)
equals the numpy rule of the loop, `sampling.verify`, exactly: same a, same token, for greedy
and sampled blocks of every length, rejections, full acceptance and a residual below the floor."""
import numpy as np
import pytest

from dspark.runtime.gpu.accept import accept
from dspark.runtime.sampling import softmax, verify


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


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_matches_the_host_rule(temperature):
    rng = np.random.default_rng(0)
    seen = set()
    for i in range(300):
        ell = i % 8
        drafts, p_d, logits, u, ue = case(rng, ell, 11, temperature, agree=[0.0, 0.3, 3.0][i % 3])
        want = verify(drafts, p_d, logits, temperature, u, ue)
        got = accept(np, drafts, p_d, logits, temperature, u, ue)
        assert tuple(got.tolist()) == want, (i, ell, want, got)
        seen.add(want[0] == ell)
    assert seen == {True, False}, "both rejections and full acceptance must occur"


def test_residual_below_the_floor_draws_from_the_target():
    p_t_logits = np.log(np.array([[0.5, 0.5, 1e-30], [0.2, 0.3, 0.5]]))
    p_d = np.array([[0.5, 0.5, 0.0]], np.float32)  # p_d == p_t: residual mass 0
    drafts = np.array([2], np.int64)  # p_t(2) ~ 0: rejected
    for ue in (0.1, 0.7):
        want = verify(drafts, p_d, p_t_logits, 1.0, np.array([0.5]), ue)
        assert tuple(accept(np, drafts, p_d, p_t_logits, 1.0, np.array([0.5]), ue).tolist()) == want
