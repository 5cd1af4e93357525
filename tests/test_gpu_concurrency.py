"""Concurrent requests in the shared GPU layer, on the CPU `TorchDevice` (whose `capture` re-runs
the body instead of capturing a CUDA graph): batch buckets, greedy and sampled outputs of R = 4
requests against their solo runs, requests joining and leaving between steps (dummy rows of free
slots included), batched steps (with a floor) against the PyTorch reference row by row, the
`cost` scheduler's skipped steps and catch-up rounds, and static buffers that keep their
addresses across calls of a bucket."""
import numpy as np
import pytest
from factories import copy_drafter, reference_logits, step_batch, tiny_target

from dspark.export import TorchBackend
from dspark.export.cuda_graph_backend import cuda_graph_backend
from dspark.runtime import EngineCore, FixedLength, InputError, Request, SamplingParams, generate, generate_batch
from dspark.runtime.backends.gpu.buckets import Buckets
from dspark.runtime.tools.parity import greedy_match

PROMPTS = [[5, 6, 7, 8], [11, 3, 42, 42, 9, 17, 60, 5, 6, 7, 8, 9, 10], [70], [8, 8, 30, 31, 32, 33],
           [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 61, 62, 63], [2, 90]]
MAX_SEQ = 128


@pytest.fixture(scope="module")
def models(one_torch_thread):
    target = tiny_target("llama", seed=3)
    return target, copy_drafter(target, block_size=4)


def gpu_layer(models, slots: int, **kw):
    target, drafter = models
    return cuda_graph_backend(target, drafter, MAX_SEQ, device="cpu", prefill_chunk=5, min_context=8, slots=slots, **kw)


def solo(models, prompt, params):
    target, drafter = models
    return generate(TorchBackend(target, drafter, MAX_SEQ), prompt, params, FixedLength())


def batch_sizes(backend) -> set[int]:
    """The batch buckets the target's kept buffers were made for."""
    return {dict(key[1:])["input_ids"][0] for key in backend.runners["target"].entries}


def test_batch_buckets_double_up_to_the_slots():
    b = Buckets(max_seq=64, max_query=8, prefill_chunk=8, max_batch=16)
    assert b.batches == (1, 2, 4, 8, 16)
    assert [b.batch(r) for r in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert Buckets(max_seq=64, max_query=8, prefill_chunk=8, max_batch=6).batches == (1, 2, 4, 6)
    assert Buckets(max_seq=64, max_query=8, prefill_chunk=8).batches == (1,)
    for rows in (0, 17):
        with pytest.raises(InputError):
            b.batch(rows)
    with pytest.raises(InputError):
        Buckets(max_seq=64, max_query=8, prefill_chunk=8, max_batch=0)


@pytest.mark.parametrize("device_acceptance", [True, False], ids=["device-acceptance", "host-acceptance"])
def test_r4_outputs_are_the_solo_runs(models, device_acceptance):
    """Six requests on four slots (two join as others finish, so batches shrink through the
    buckets): greedy outputs identical to the solo runs in the sense of dspark.md §1, and sampled
    ones token for token (FixedLength: the same ℓ as alone, and each request's own uniforms)."""
    target, _ = models
    be = gpu_layer(models, 4, device_acceptance=device_acceptance)
    budgets = [40, 24, 40, 12, 32, 40]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature, n, seed) for seed, n in enumerate(budgets)]
        got = generate_batch(be, [Request(p, q) for p, q in zip(PROMPTS, params)], FixedLength())
        for prompt, q, g in zip(PROMPTS, params, got):
            alone = solo(models, prompt, q)
            if temperature == 0:
                m = greedy_match(alone.token_ids, g.token_ids, reference_logits(target, prompt, alone.token_ids))
                assert m.ok, f"{prompt}: {m}"
            else:
                assert g.token_ids == alone.token_ids, prompt
        assert max(g.stats.batch[0] for g in got) == 4 and min(min(g.stats.batch) for g in got) < 4
        assert max(g.stats.tau for g in got) > (1.2 if temperature == 0 else 1.0), "no draft accepted"
    assert {1, 4} <= batch_sizes(be) <= set(be.buckets.batches)  # batch buckets only, 4 down to 1
    s = be.stats
    assert s["target"].replays > s["target"].captures > 0 and not s["target"].capture_failures


def test_requests_join_and_leave_between_steps(models):
    """a, b, c start on three slots; b is aborted after 3 steps, so slot 1 rides along as a dummy
    row for two steps; then d joins that slot. a, c and d produce their solo outputs, and b's
    tokens are the beginning of its solo output."""
    target, _ = models
    core = EngineCore(gpu_layer(models, 3), FixedLength())
    params = {"a": SamplingParams(0.0, 40), "b": SamplingParams(0.0, 40), "c": SamplingParams(0.0, 16),
              "d": SamplingParams(0.0, 30)}
    prompts = dict(zip("abcd", PROMPTS))
    for rid in "abc":
        core.add_request(rid, prompts[rid], params[rid])
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for out in core.step():
            outputs[out.request_id] = list(out.token_ids)

    for _ in range(3):
        step()
    aborted = core.abort_request("b")
    assert core.slots[1] is None and core.running == 2
    for _ in range(2):
        step()  # slots 0 and 2 busy: slot 1 is a dummy row of the batch
    core.add_request("d", prompts["d"], params["d"])
    step()
    assert core.slots[1] is not None and core.slots[1].request_id == "d"
    while core.has_unfinished():
        step()
    for rid in "acd":
        alone = solo(models, prompts[rid], params[rid]).token_ids
        m = greedy_match(alone, outputs[rid], reference_logits(target, prompts[rid], alone))
        assert m.ok, f"{rid}: {m}"
    alone_b = solo(models, prompts["b"], params["b"]).token_ids
    assert 0 < len(aborted.token_ids) < 40 and aborted.token_ids == alone_b[:len(aborted.token_ids)]


def test_batched_steps_match_reference_rows(models):
    """Two slots at different lengths: a drafting round with one new context row each, a
    verification with 1 + 1 and 1 + 4 tokens (one row padded), sampled, then a round with 1 + a
    and 3 new context rows (one row padded) and a floor on one row, against the PyTorch reference
    row by row; acceptance on the device for both rows."""
    target, drafter = models
    be, ref = gpu_layer(models, 2), TorchBackend(target, drafter, MAX_SEQ, slots=2)
    ids = [np.array(PROMPTS[1], np.int64), np.array(PROMPTS[3], np.int64)]
    feats = []
    for slot, x in enumerate(ids):
        (lg, fg), (lr, fr) = be.prefill(slot, x, True), ref.prefill(slot, x, True)
        np.testing.assert_allclose(lg, lr, atol=1e-4)
        feats.append(fr)
    counts = np.array([1, 1])
    starts = np.array([len(ids[0]), len(ids[1])])
    args = (counts, starts - counts, np.array([7, 8]), np.ones(2), np.random.default_rng(0).random((2, 4)))
    d, r = be.draft(step_batch(np.stack(feats), *args)), ref.draft(step_batch(np.stack(feats), *args))
    assert d.tokens.tolist() == r.tokens.tolist()
    tokens = np.concatenate([np.array([[7], [8]]), d.tokens], axis=1)  # [2, 5]
    batch = step_batch(np.stack(feats), *args)
    batch.lengths, batch.tokens = np.array([1, 4]), tokens
    batch.uniforms[:, 4:] = 0.5
    vg, vr = be.verify(batch, d), ref.verify(batch, r)
    assert vg.accepted.tolist() == vr.accepted.tolist() and vg.emitted.tolist() == vr.emitted.tolist()
    np.testing.assert_allclose(vg.features, vr.features, atol=1e-4)
    # the next round: row 0 feeds 1 + a rows, row 1 three (one row padded), at their new positions
    a = vg.accepted
    counts = np.array([a[0] + 1, 3])
    features = np.zeros((2, 3, vg.features.shape[2]), np.float32)
    features[0, :counts[0]], features[1] = vg.features[0, :counts[0]], vg.features[1, :3]
    starts = starts + counts
    args = (counts, starts - counts, np.array([9, 10]), np.array([0.0, 1.0]), np.random.default_rng(1).random((2, 4)))
    floors = np.array([0, 3])  # row 1's context restarts at position 3
    d, r = be.draft(step_batch(features, *args, floors=floors)), ref.draft(step_batch(features, *args, floors=floors))
    assert d.tokens.tolist() == r.tokens.tolist()
    np.testing.assert_allclose(d.probs[1], r.probs[1], atol=1e-5)
    np.testing.assert_allclose(d.confidence_logits, r.confidence_logits, atol=1e-4)


def test_static_buffers_keep_their_addresses(models):
    """Every kept bucket's input buffers and the KV caches are the same memory on every call: a
    second batch of requests (other lengths, other contexts) reuses them."""
    be = gpu_layer(models, 4)
    params = SamplingParams(0.0, 24)

    def addresses() -> dict:
        out = {}
        for role, runner in be.runners.items():
            out[role, "kv"] = [c.data_ptr() for c in runner.kv]
            for key, entry in runner.entries.items():
                out[role, key] = {name: a.data_ptr() for name, a in entry.inputs.items()}
        return out

    generate_batch(be, [Request(p, params) for p in PROMPTS[:4]], FixedLength())
    first, replays = addresses(), be.stats["target"].replays
    generate_batch(be, [Request(p, params) for p in PROMPTS[2:]], FixedLength())
    second = addresses()
    assert be.stats["target"].replays > replays + 10
    shared = set(first) & set(second)
    assert len(shared) > 10 and all(first[k] == second[k] for k in shared)


def test_cost_scheduler_skips_and_catches_up(models):
    """The `cost` scheduler skips the drafter for whole steps; the next round feeds each request up
    to `catch_up` rows (6 here, so that contexts restart at a floor), in chunks, with dummy rows: at
    R = 3 on the GPU layer the greedy outputs stay the target's own, with steps both drafted and
    skipped."""
    from factories import TINY_CALIBRATION, TINY_SPS

    from dspark.runtime import make_scheduler

    target, _ = models
    be = gpu_layer(models, 3)
    params = SamplingParams(0.0, 40)
    got = generate_batch(be, [Request(p, params) for p in PROMPTS[:5]],
                         make_scheduler("cost", sps=TINY_SPS, calibration=TINY_CALIBRATION), catch_up=6)
    for prompt, g in zip(PROMPTS, got):
        alone = generate(TorchBackend(target, None, MAX_SEQ), prompt, params, None).token_ids
        m = greedy_match(alone, g.token_ids, reference_logits(target, prompt, alone))
        assert m.ok, f"{prompt}: {m}"
    drafted, cycles = sum(sum(g.stats.drafted) for g in got), sum(g.stats.cycles for g in got)
    assert 0 < drafted < cycles, f"the drafter gate should skip some steps ({drafted} of {cycles} drafted)"
