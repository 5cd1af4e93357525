"""The shared GPU layer on the CPU: bucket selection, padded masks, chunking, and the whole
`GraphBackend` path (static buffers, KV row writes from device positions, chunked prefill and
drafting, graph bookkeeping) run by the PyTorch steps on a CPU `TorchDevice`, whose `capture`
re-runs the body instead of capturing a CUDA graph. The capture itself needs a GPU
(scripts/gpu_check.sh)."""
import numpy as np
import pytest
from factories import copy_drafter, reference_logits, step_batch, tiny_target

from dspark.export import TorchBackend
from dspark.export.cuda_graph_backend import cuda_graph_backend
from dspark.runtime import FixedLength, InputError, SamplingParams, StaticThreshold, generate
from dspark.runtime.backends.gpu.buckets import Buckets
from dspark.runtime.graph_io import MASKED
from dspark.runtime.kv import row_mask
from dspark.runtime.tools.parity import greedy_match

PROMPTS = [[5, 6, 7, 8], [11, 3, 42, 42, 9, 17, 60, 5, 6, 7, 8, 9, 10], [70]]


def test_context_buckets_double_up_to_max_seq():
    b = Buckets(max_seq=1000, max_query=8, min_context=128)
    assert b.contexts == (128, 256, 512, 1000)
    assert [b.context(n) for n in (0, 1, 128, 129, 511, 512, 513, 1000)] == [128, 128, 128, 256, 512, 512, 1000, 1000]
    assert Buckets(max_seq=64, max_query=8, prefill_chunk=8).contexts == (64,)
    with pytest.raises(InputError):
        b.context(1001)


def test_graphable_and_chunks():
    b = Buckets(max_seq=256, max_query=8, prefill_chunk=16)
    assert b.graphable(8) and not b.graphable(9)
    assert b.chunks(40) == [(0, 16), (16, 32), (32, 40)]
    assert b.chunks(16) == [(0, 16)] and b.chunks(1) == [(0, 1)]
    for bad in (dict(max_seq=1, max_query=1), dict(max_seq=64, max_query=8, prefill_chunk=4)):
        with pytest.raises(InputError):
            Buckets(**bad)


def test_past_mask_pads_to_the_bucket():
    m = row_mask(np.array([3]), 8)
    assert m.shape == (1, 8) and (m[0, :3] == 0).all() and (m[0, 3:] == MASKED).all()
    assert (row_mask(np.array([0]), 4) == MASKED).all()  # an empty past: every row masked, no zero-size axis
    m = row_mask(np.array([5]), 8, floors=np.array([2]))  # the context restarts at position 2
    assert (m[0, 2:5] == 0).all() and (m[0, :2] == MASKED).all() and (m[0, 5:] == MASKED).all()
    m = row_mask(np.array([5, 0, 2]), 8, floors=np.array([2, 0, 0]))  # a batch: each row its own length and floor
    assert (m == 0).sum(1).tolist() == [3, 0, 2] and (m[0, 2:5] == 0).all() and (m[2, :2] == 0).all()


@pytest.fixture(scope="module")
def models(one_torch_thread):
    target = tiny_target("llama", seed=3)
    return target, copy_drafter(target, block_size=4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("graphs,device_acceptance", [(True, True), (True, False), (False, True)],
                         ids=["replayed", "replayed-host-acceptance", "eager"])
def test_graph_backend_matches_torch_reference(models, temperature, graphs, device_acceptance):
    """Small chunks and context buckets, so prefill is chunked (also the first drafting round),
    calls cross context buckets, and buckets are reused with other lengths in device memory."""
    target, drafter = models
    taus = []
    for seed, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature, 48, seed)
        ref = generate(TorchBackend(target, drafter, 128), prompt, params, FixedLength())
        be = cuda_graph_backend(target, drafter, 128, device="cpu", graphs=graphs, prefill_chunk=5, min_context=8,
                                device_acceptance=device_acceptance)
        assert be.accepts_on_device == device_acceptance
        got = generate(be, prompt, params, FixedLength())
        if temperature == 0:
            m = greedy_match(ref.token_ids, got.token_ids, reference_logits(target, prompt, ref.token_ids))
            assert m.ok, f"{prompt}: {m}"
        else:  # same uniforms: identical unless a draw lands within ~1e-7 of a CDF boundary
            assert got.token_ids == ref.token_ids, prompt
        assert got.stats.emitted == ref.stats.emitted
        taus.append(got.stats.tau)
        s = be.stats
        assert not s["target"].capture_failures and not s["drafter"].capture_failures
        if graphs:
            assert s["target"].replays > s["target"].captures > 0 and s["drafter"].replays > 0
            assert s["target"].captures <= 2 * 5 * len(be.buckets.contexts)  # (S, K) pairs x context buckets
        else:
            assert s["target"].captures == s["drafter"].captures == 0
    assert max(taus) > (1.2 if temperature == 0 else 1.0), "no draft accepted: the acceptance path is untested"


def test_graph_backend_target_alone_and_threshold(models):
    target, drafter = models
    params = SamplingParams(0.0, 40)
    alone = generate(TorchBackend(target, None, 96), PROMPTS[1], params, None)
    got = generate(cuda_graph_backend(target, None, 96, device="cpu", prefill_chunk=4), PROMPTS[1], params, None)
    assert got.token_ids == alone.token_ids
    be = cuda_graph_backend(target, drafter, 96, device="cpu", prefill_chunk=5)
    spec = generate(be, PROMPTS[1], params, StaticThreshold(0.5))
    assert greedy_match(alone.token_ids, spec.token_ids, reference_logits(target, PROMPTS[1], alone.token_ids)).ok


def test_graph_backend_steps_match_reference_rows(models):
    """Step level: every prompt row's logits and features, across chunk boundaries; the loop's
    prefill (the drafter fed in chunks); a drafting round."""
    target, drafter = models
    be = cuda_graph_backend(target, drafter, 64, device="cpu", prefill_chunk=5, min_context=8)
    ref = TorchBackend(target, drafter, 64)
    ids = np.array(PROMPTS[1], np.int64)
    zero = np.zeros(1, np.int64)
    (lg, fg), (lr, fr) = be.target(ids[None], zero), ref.target(ids[None], zero)  # [1, n, V], [1, n, F]
    assert lg.shape == lr.shape and np.abs(lg - lr).max() < 1e-4 and np.abs(fg - fr).max() < 1e-4
    (lp, fp), (lq, fq) = be.prefill(0, ids, True), ref.prefill(0, ids, True)  # [V], [1, F]
    assert lp.shape == lq.shape and np.abs(lp - lq).max() < 1e-4 and np.abs(fp - fq).max() < 1e-4
    with pytest.raises(InputError):
        be.target(ids[None], zero + 60)  # past max_seq
    n = len(ids)
    args = (np.ones(1, np.int64), zero + n - 1, np.array([5]), np.ones(1), np.full((1, 4), 0.5))
    d, r = be.draft(step_batch(fp[None], *args)), ref.draft(step_batch(fq[None], *args))  # probs on the device until read
    assert d.tokens.shape == (1, 4) and d.tokens.tolist() == r.tokens.tolist()
    assert np.abs(d.probs - r.probs).max() < 1e-5
    floors = np.array([3])  # the same round with the context restarting at position 3
    df = be.draft(step_batch(fp[None], *args, floors=floors))
    rf = ref.draft(step_batch(fq[None], *args, floors=floors))
    assert df.tokens.tolist() == rf.tokens.tolist() and np.abs(df.probs - rf.probs).max() < 1e-5
    np.testing.assert_allclose(df.confidence_logits, rf.confidence_logits, atol=1e-4)
    assert np.abs(df.confidence_logits - d.confidence_logits).max() > 1e-2  # the floor masked something
