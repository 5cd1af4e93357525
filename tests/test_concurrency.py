"""Concurrent requests on the exported engine (tiny random model): R slots, requests joining
and leaving, every scheduler; a request's greedy output is the one it gets alone and its
sampled output follows its own RNG stream. Plus the bundle's SPS table and calibration:
the fallback without them and clear errors for corrupt ones."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from factories import TINY_SPS, Replay, reference_logits, step_batch

from dspark.runtime import (BundleError, Calibration, Engine, InputError, Request, SamplingParams, SpsTable, generate,
                            generate_batch)
from dspark.runtime.tools.cli import main
from dspark.runtime.backends.onnxruntime import INT8_MAX_SLOTS
from dspark.runtime.tools.parity import greedy_match

PROMPTS = ["Hello there, how are you?", "What is 17 * 23?", "Tell me a story about a dragon.", "Hi",
           "abc def ghi jkl mno pqr"]
SLOTS = 3
MAX_SEQ = 160
SCHEDULERS = ["none", "fixed", "threshold", "prefix", "async", "cost"]
SPS = TINY_SPS


@pytest.fixture(scope="module")
def engines(profiled):
    return Engine.load(profiled, max_seq=MAX_SEQ), Engine.load(profiled, max_seq=MAX_SEQ, slots=SLOTS)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_greedy_batch_identical_to_solo(tiny_bundle, engines, scheduler):
    solo_engine, batch_engine = engines
    batch = batch_engine.generate_batch(PROMPTS, max_new_tokens=40, scheduler=scheduler)
    lengths = set()
    for prompt, got in zip(PROMPTS, batch):
        alone = solo_engine.generate(prompt, max_new_tokens=40, scheduler=scheduler)
        ids = solo_engine.encode(prompt)
        m = greedy_match(alone.token_ids, got.token_ids, reference_logits(tiny_bundle.target, ids, alone.token_ids))
        assert m.ok, f"{prompt!r} ({scheduler}): {m}"
        lengths.update(got.stats.verified)
    assert [g.stats.batch[0] for g in batch[:SLOTS]] == [SLOTS] * SLOTS  # the first R start together
    assert all(len(g.token_ids) == 40 for g in batch)  # the rest joined freed slots and finished too
    if scheduler in ("threshold", "prefix", "async", "cost"):
        assert len(lengths) > 1, f"{scheduler}: verified lengths {sorted(lengths)} should vary"
    if scheduler == "cost":
        drafted = sum(sum(g.stats.drafted) for g in batch)
        cycles = sum(g.stats.cycles for g in batch)
        assert 0 < drafted < cycles, f"the drafter gate should skip some steps ({drafted} of {cycles} drafted)"


@pytest.mark.parametrize("graph", ["ort", "portable"])
def test_batched_steps_match_torch_rows(tiny_bundle, engines, graph):
    """Two slots at different lengths: a drafting round with 1 and 3 new context rows (one row
    padded) and a verification with 1 + 1 and 1 + 4 tokens (one row padded), against the torch
    reference row by row, sampled."""
    from dspark.export import TorchBackend
    from dspark.runtime.manifest import Manifest
    from dspark.runtime.backends.onnxruntime import OrtBackend

    solo_engine, _ = engines
    manifest = Manifest.load(tiny_bundle.path)
    ob = OrtBackend(tiny_bundle.path, manifest, MAX_SEQ, target_graph=graph, drafter_graph="fp32", slots=2)
    tb = TorchBackend(tiny_bundle.target, tiny_bundle.drafter, MAX_SEQ, slots=2)
    ids = [np.asarray(solo_engine.encode(p), np.int64) for p in PROMPTS[:2]]
    feats = []
    for slot, x in enumerate(ids):
        (lo, fo), (lr, fr) = ob.prefill(slot, x, True), tb.prefill(slot, x, True)
        np.testing.assert_allclose(lo, lr, atol=1e-4)
        feats.append(fr)
    # slot 1 takes two more target tokens first, so that it feeds the drafter 3 context rows
    extra = np.array([[5, 6]], np.int64)
    ob._run_target(1, extra, np.array([len(ids[1])]), np.zeros((1, 1), np.int64), "target")
    (_, fr1) = tb._row(1, extra[0], len(ids[1]))
    counts = np.array([1, 3])
    features = np.zeros((2, 3, manifest.drafter.feature_dim), np.float32)
    features[0, :1], features[1] = feats[0], np.concatenate([feats[1], fr1])
    starts = np.array([len(ids[0]), len(ids[1]) + 2])
    args = (counts, starts - counts, np.array([7, 8]), np.ones(2, np.float32), np.random.default_rng(0).random((2, 4)))
    do, dr = ob.draft(step_batch(features, *args)), tb.draft(step_batch(features, *args))
    assert do.tokens.tolist() == dr.tokens.tolist()
    np.testing.assert_allclose(do.probs, dr.probs, atol=1e-4)
    np.testing.assert_allclose(do.confidence_logits, dr.confidence_logits, atol=1e-4)
    tokens = np.concatenate([np.array([[7], [8]]), do.tokens], axis=1)  # [2, 5]; row 0 verifies one draft
    lo, fo = ob.target(tokens, starts)
    np.testing.assert_allclose(lo[0, :2], tb.target(tokens[:1, :2], starts[:1])[0][0], atol=1e-4)
    np.testing.assert_allclose(lo[1], tb._row(1, tokens[1], int(starts[1]))[0], atol=1e-4)


def test_drafter_floor_masks_older_context(tiny_bundle, engines):
    """Past a floor the drafter reads only [floor, start): slot 1, whose cache below the floor holds
    another context, drafts what slot 0 drafts, on both backends; without the floor it would not."""
    from dspark.export import TorchBackend
    from dspark.runtime.manifest import Manifest
    from dspark.runtime.backends.onnxruntime import OrtBackend

    solo_engine, _ = engines
    manifest = Manifest.load(tiny_bundle.path)
    ob = OrtBackend(tiny_bundle.path, manifest, MAX_SEQ, drafter_graph="fp32", slots=2)
    tb = TorchBackend(tiny_bundle.target, tiny_bundle.drafter, MAX_SEQ, slots=2)
    ids = np.asarray(solo_engine.encode(PROMPTS[2]), np.int64)
    n, floor = len(ids), len(ids) - 3
    _, feats = ob.prefill(0, ids, False)  # [n, F]: without ingest, every prompt row comes back
    assert feats.shape == (n, manifest.drafter.feature_dim)
    other = np.random.default_rng(1).normal(size=(floor, feats.shape[1])).astype(np.float32)
    gamma = ob.block_size
    zeros2 = (np.zeros(2, np.int64), np.zeros(2, np.float32), np.zeros((2, gamma)))
    for be in (ob, tb):  # positions [0, floor): the real rows in slot 0, other rows in slot 1
        be.draft(step_batch(np.stack([feats[:floor], other]), np.full(2, floor), np.zeros(2, np.int64), *zeros2))
    recent = np.stack([feats[floor:]] * 2)  # [2, 3, F]
    args = (np.full(2, n - floor), np.full(2, floor), np.array([7, 7]), np.zeros(2, np.float32), np.zeros((2, gamma)))
    (do, dt), (wo, wt) = [[be.draft(step_batch(recent, *args, floors=np.full(2, f))) for be in (ob, tb)] for f in (floor, 0)]
    for d in (do, dt):
        assert d.tokens[0].tolist() == d.tokens[1].tolist()
        np.testing.assert_allclose(d.confidence_logits[0], d.confidence_logits[1], atol=1e-5)
    assert do.tokens.tolist() == dt.tokens.tolist()
    np.testing.assert_allclose(do.confidence_logits, dt.confidence_logits, atol=1e-4)
    assert not np.allclose(wo.confidence_logits[0], wo.confidence_logits[1], atol=1e-3)  # the floor did it


def test_skipped_steps_catch_up_within_a_window(tiny_bundle, engines):
    """With the drafter gate skipping steps, requests joining meanwhile are not fed to the drafter
    at join, and a round after a long skip feeds at most `catch_up` rows with the context
    restarting there (asserted: both happen); greedy outputs stay those of the target alone."""
    from dspark.runtime.schedulers import make_scheduler

    solo_engine, batch_engine = engines
    inner, seen = batch_engine.backend, {"deferred": 0, "floored": 0, "max_rows": 0}

    class Recording:
        block_size, vocab_size, max_seq, slots = inner.block_size, inner.vocab_size, inner.max_seq, inner.slots
        accepts_on_device, drafter_graph, on_run = False, inner.drafter_graph, None

        def prefill(self, slot, tokens, ingest):
            seen["deferred"] += not ingest
            return inner.prefill(slot, tokens, ingest)

        def target(self, tokens, starts):
            return inner.target(tokens, starts)

        def draft(self, batch):
            seen["floored"] += int((batch.floors > 0).sum())
            seen["max_rows"] = max(seen["max_rows"], int(batch.counts.max()))
            return inner.draft(batch)

        def verify(self, batch, draft):
            return inner.verify(batch, draft)

    prompts = PROMPTS * 2
    budgets = [12, 40, 25, 40, 8, 30, 40, 12, 40, 20]  # requests leave at different steps
    requests = [Request(solo_engine.encode(p), SamplingParams(0.0, m)) for p, m in zip(prompts, budgets)]
    catch_up = inner.block_size + 1
    dear = make_scheduler("cost", sps=SpsTable(SPS.sps, (1.0, 1.2, 1.4)), calibration=batch_engine.calibration)
    gens = generate_batch(Recording(), requests, dear, catch_up=catch_up)  # a dear drafter: long skips
    assert seen["deferred"] > 0 and seen["floored"] > 0, seen
    assert seen["max_rows"] <= catch_up, seen
    for req, got in zip(requests, gens):
        ids = list(req.prompt_ids)
        alone = generate(solo_engine.backend, ids, req.params, None)
        m = greedy_match(alone.token_ids, got.token_ids, reference_logits(tiny_bundle.target, ids, alone.token_ids))
        assert m.ok, m
    with pytest.raises(InputError, match="catch_up"):
        generate_batch(inner, requests[:1], batch_engine.scheduler("cost"), catch_up=inner.block_size)


def test_portable_graph_batches_too(tiny_bundle, profiled, engines):
    """The standard-op target graph (what TensorRT reads) serves batched verification by itself."""
    solo_engine, _ = engines
    portable = Engine.load(profiled, max_seq=MAX_SEQ, slots=SLOTS, target_graph="portable")
    assert not portable.backend.in_place
    for prompt, got in zip(PROMPTS, portable.generate_batch(PROMPTS, max_new_tokens=30, scheduler="prefix")):
        alone = solo_engine.generate(prompt, max_new_tokens=30, scheduler="prefix")
        ids = solo_engine.encode(prompt)
        m = greedy_match(alone.token_ids, got.token_ids, reference_logits(tiny_bundle.target, ids, alone.token_ids))
        assert m.ok, f"{prompt!r}: {m}"


class Coupled:
    """A deliberately broken backend: row 0's new context features leak into row 1's drafting round."""

    def __init__(self, inner):
        self.inner = inner
        for name in ("block_size", "vocab_size", "max_seq", "slots", "accepts_on_device", "drafter_graph", "on_run"):
            setattr(self, name, getattr(inner, name))

    def prefill(self, slot, tokens, ingest):
        return self.inner.prefill(slot, tokens, ingest)

    def target(self, tokens, starts):
        return self.inner.target(tokens, starts)

    def draft(self, batch):
        if len(batch.counts) > 1 and batch.counts[0] and batch.counts[1]:
            n = min(batch.counts[0], batch.counts[1])
            batch.features[1, :n] += batch.features[0, :n]
        return self.inner.draft(batch)

    def verify(self, batch, draft):
        return self.inner.verify(batch, draft)


def sampled_batch_mismatches(profiled, scheduler: str, graph: str, coupled: bool = False) -> list[str]:
    """Decode PROMPTS sampled, SLOTS at a time; then each request alone under `Replay` of the decisions
    it met in the batch (whether the drafter ran, ℓ). Returns the prompts whose solo tokens differ.

    Why a replay and not the solo run under the same scheduler: a batched and a solo verification
    run different target graphs (the portable one batches rows, the ONNX Runtime one serves one
    row), whose features differ in their last bits; the int8 drafter's per-call activation scale
    turns that into confidence differences of ~0.1 in logit, so a confidence near the threshold
    can fall on either side of it, ℓ differs, and a sampled request then uses its draws
    differently: another exact sample of the target, not the same one (this is what failed on
    AVX2-only machines). Everything else of a request - its drafts, its verification, its random
    stream - must not depend on its neighbours, which the replay checks token for token."""
    solo_engine = Engine.load(profiled, max_seq=MAX_SEQ, drafter_graph=graph)
    batch_engine = Engine.load(profiled, max_seq=MAX_SEQ, slots=SLOTS, drafter_graph=graph)
    assert batch_engine.backend.drafter_int8 == solo_engine.backend.drafter_int8 == (graph == "int8")
    seeds = [7, 8, 9, 10, 11]
    requests = [Request(solo_engine.encode(p), batch_engine.params(1.0, 30, seed)) for p, seed in zip(PROMPTS, seeds)]
    backend = Coupled(batch_engine.backend) if coupled else batch_engine.backend
    sched = batch_engine.scheduler(scheduler)
    bad = []
    for prompt, req, got in zip(PROMPTS, requests, generate_batch(backend, requests, sched)):
        s = got.stats
        if scheduler == "threshold":  # each decision is the request's own: its confidences alone
            # ℓ is capped by the budget left after the anchor; the prefill token and each cycle's are out
            caps = [req.params.max_new_tokens - 1 - (1 + sum(s.emitted[:i])) for i in range(s.cycles)]
            own = [min(int(sched.lengths(c[None], None)[0]), cap) for c, cap in zip(s.confidences, caps)]
            assert own == s.verified, f"{prompt!r}: threshold decisions {s.verified} are not its own {own}"
        alone = generate(solo_engine.backend, req.prompt_ids, req.params, Replay(s))
        if alone.token_ids != got.token_ids:
            bad.append(prompt)
    return bad


@pytest.mark.parametrize("graph", ["int8", "fp32"])
@pytest.mark.parametrize("scheduler", ["fixed", "threshold"])
def test_sampled_batch_follows_each_requests_rng(profiled, scheduler, graph):
    """A sampled request in a batch meets the scheduler's decisions from its own confidences and
    otherwise draws exactly what it draws alone: with either drafter graph (the int8 one drafts row
    by row, so that its per-call activation scale couples no rows; the fp32 one drafts all rows in
    one call). `sampled_batch_mismatches` says why it replays the decisions."""
    assert sampled_batch_mismatches(profiled, scheduler, graph) == []


def test_sampled_batch_check_catches_a_coupling(profiled):
    """The same check fails when row 0's features leak into row 1's drafting round."""
    assert sampled_batch_mismatches(profiled, "threshold", "int8", coupled=True) != []


def test_auto_drafter_graph_follows_the_slot_count(engines):
    """Sampled rows: int8 row by row while it is the cheaper (at most INT8_MAX_SLOTS slots), one
    fp32 call above. Greedy calls: the greedy-only int8 graph over every row, at any slot count."""
    solo_engine, batch_engine = engines
    assert SLOTS > INT8_MAX_SLOTS
    assert solo_engine.backend.drafter_int8 and not batch_engine.backend.drafter_int8
    assert solo_engine.backend.drafter_graph == batch_engine.backend.drafter_graph == "int8-greedy"


def test_kv_buffers_sized_at_load(engines):
    _, batch_engine = engines
    be = batch_engine.backend
    pointers = [a.ctypes.data for a in be.target_kv.arrays + be.draft_kv.arrays]
    batch_engine.generate_batch(PROMPTS, max_new_tokens=20)
    assert [a.ctypes.data for a in be.target_kv.arrays + be.draft_kv.arrays] == pointers
    assert all(a.shape[0] == SLOTS and a.shape[2] == MAX_SEQ for a in be.target_kv.arrays)


# --- the SPS table and calibration in the bundle -------------------------------------------------------

def test_auto_scheduler(tiny_bundle, engines):
    solo_engine, _ = engines
    assert solo_engine.scheduler("auto").name == "cost"  # the table has the drafter's cost
    assert Engine(tiny_bundle.path, solo_engine.manifest, solo_engine.backend, solo_engine.tokenizer,
                  SpsTable(SPS.sps), solo_engine.calibration).scheduler("auto").name == "prefix"
    bare = Engine.load(tiny_bundle.path, max_seq=MAX_SEQ)
    with pytest.warns(UserWarning, match="dspark profile.*dspark calibrate.*falls back to `fixed`"):
        r = bare.generate(PROMPTS[0], max_new_tokens=20)
    assert r.token_ids == bare.generate(PROMPTS[0], max_new_tokens=20, scheduler="fixed").token_ids
    with pytest.raises(InputError, match="dspark profile"):
        bare.generate(PROMPTS[0], max_new_tokens=20, scheduler="prefix")


def test_cli_prints_the_fallback_warning(tiny_bundle, capsys):
    assert main(["generate", "--bundle", str(tiny_bundle.path), "--prompt", "Hi", "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "warning: bundle" in err and "falls back to `fixed`" in err and "DSpark (auto)" in err


def _broken(profiled, tmp_path, name: str, content: str):
    path = tmp_path / "bundle"
    shutil.copytree(profiled, path)
    (path / name).write_text(content)
    return path


@pytest.mark.parametrize("name,content,fix", [
    ("sps.json", "{not json", "dspark profile"),
    ("sps.json", json.dumps({"format": 1, "sps": [1.0, -0.5]}), "dspark profile"),
    ("sps.json", json.dumps({"format": 1, "sps": []}), "dspark profile"),
    ("sps.json", json.dumps({"format": 7, "sps": [1.0]}), "dspark profile"),
    ("calibration.json", json.dumps({"format": 1, "temperatures": [1.0, 0.0, 1.0, 1.0]}), "dspark calibrate"),
    ("calibration.json", json.dumps({"format": 1, "temperatures": [1.0, -2.0, 1.0, 1.0]}), "dspark calibrate"),
    ("calibration.json", json.dumps({"format": 1, "temperatures": [1.0, 1.0]}), "dspark calibrate"),
    ("calibration.json", "[]", "dspark calibrate"),
])
def test_corrupt_tables_are_clear_errors(profiled, tmp_path, capsys, name, content, fix):
    path = _broken(profiled, tmp_path, name, content)
    with pytest.raises(BundleError, match=fix):
        Engine.load(path, max_seq=MAX_SEQ)
    capsys.readouterr()
    assert main(["generate", "--bundle", str(path), "--prompt", "Hi", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and name in err and fix in err


def test_calibration_temperature_must_be_positive():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InputError, match="expected a finite number > 0"):
            Calibration((1.0, bad))
    a = Calibration((1.0, 2.0)).survival(np.array([[2.0, -1.0], [0.0, 3.0]]))
    assert (np.diff(a, axis=1) <= 0).all() and a[1, 0] == 0.5
