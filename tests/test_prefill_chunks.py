"""Chunked prefill and prefix reuse in the engine core (runtime/core.py) on the tiny bundle: a prompt
prefilled P tokens a step, or from a free slot's kept prefix, gives the output of a prefill at once
(greedy: identical in the floating-point sense of dspark.md §1; sampled with a seed, with the fp32
drafter: token for token, because the drafter's context ends up the same), running requests keep
committing while a long prompt prefills, and a backend that cannot start a prefill at a position
gets whole prompts."""
from __future__ import annotations

import numpy as np
import pytest
from factories import copy_drafter, reference_logits, tiny_target

from dspark.runtime import Engine, EngineCore, FixedLength, InputError, Request, SamplingParams, generate_batch
from dspark.runtime.tools.parity import greedy_match

MAX_SEQ = 256
LONG = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree by the river."
SHORT = "What is 17 * 23?"


@pytest.fixture(scope="module")
def engines(profiled):
    """Two slots; the fp32 drafter graph, whose context rows do not depend on how many a call feeds
    (the int8 graph's per-call activation scale would change the proposals, never the output)."""
    return {graph: Engine.load(profiled, max_seq=MAX_SEQ, slots=2, drafter_graph="fp32", target_graph=graph)
            for graph in ("ort", "portable")}


@pytest.fixture(scope="module")
def engine(engines):
    return engines["ort"]


def serve(core: EngineCore, until=lambda: False) -> dict:
    """Step until `until()` or nothing is left; each request's outputs, in order."""
    outputs: dict = {}
    while core.has_unfinished() and not until():
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def params(temperature: float, max_new_tokens: int, seed: int = 0) -> SamplingParams:
    """No stop tokens: the random model's outputs have the lengths asked for."""
    return SamplingParams(temperature, max_new_tokens, seed)


def alone(engine: Engine, ids: list[int], q: SamplingParams, scheduler: str = "fixed"):
    """The request on a fresh core, its prompt prefilled in one call: the reference."""
    core = engine.core(scheduler, prefill_chunk=None, min_prefix=None)
    core.add_request(0, ids, q)
    return serve(core)[0][-1]


def assert_same(tiny_bundle, ids: list[int], ref, got, sampled: bool = False) -> None:
    if sampled:
        assert got.token_ids == ref.token_ids
    else:
        m = greedy_match(ref.token_ids, got.token_ids, reference_logits(tiny_bundle.target, ids, ref.token_ids))
        assert m.ok, m
    assert got.stats.emitted == ref.stats.emitted, "the drafter's context is not what a prefill at once gives"


class PrefillLog:
    """Records the backend's prefill calls as (slot, start, tokens)."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []
        self.inner = backend.prefill

    def __enter__(self):
        def prefill(slot, tokens, ingest, start=0, last=True):
            self.calls.append((slot, start, len(tokens)))
            return self.inner(slot, tokens, ingest, start, last)

        self.backend.prefill = prefill
        return self

    def __exit__(self, *exc):
        del self.backend.prefill


@pytest.mark.parametrize("graph", ["ort", "portable"])
@pytest.mark.parametrize("scheduler", ["none", "fixed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chunked_prefill_is_the_prefill_at_once(tiny_bundle, engines, graph, scheduler, temperature):
    """P = 7 cuts the prompt into ceil(n / 7) calls at 0, 7, 14, ...; the output is the one of a
    prefill in one call, and (fixed, fp32 drafter) so are the accepted lengths, which a drafter
    context with a hole or a shifted row would change."""
    engine = engines[graph]
    ids = engine.encode(LONG)
    q = params(temperature, 40, seed=3)
    core = engine.core(scheduler, prefill_chunk=7)
    core.add_request("r", ids, q)
    with PrefillLog(engine.backend) as log:
        got = serve(core)["r"][-1]
    n = len(ids)
    assert [(start, m) for _, start, m in log.calls] == [(s, min(7, n - s)) for s in range(0, n, 7)]
    assert got.stats.cached_tokens == 0 and got.stats.times["prefill"] > 0
    assert_same(tiny_bundle, ids, alone(engine, ids, q, scheduler), got, sampled=temperature > 0)


def test_running_request_commits_every_step_while_a_long_prompt_prefills(tiny_bundle, engine):
    """A request runs; a long prompt joins with P = 7: every step until its last chunk prefills 7 of
    its tokens, returns nothing for it, and commits tokens for the running one; then both finish as
    they do alone."""
    core = engine.core("fixed", prefill_chunk=7)
    short, long_ = engine.encode(SHORT), engine.encode(LONG)
    core.add_request("a", short, params(0.0, 60))
    serve(core, until=lambda: core.running and not core.slots[0].prefilling)  # a has joined
    core.add_request("b", long_, params(0.0, 30))
    steps = -(-len(long_) // 7)
    with PrefillLog(engine.backend) as log:
        for i in range(steps):
            outs = {o.request_id: o for o in core.step()}
            assert outs["a"].new_token_ids, f"step {i}: the running request committed nothing"
            assert ("b" in outs) == (i == steps - 1), f"step {i}: b's first token comes with its last chunk"
            assert core.slots[1].prefilling == (i < steps - 1)
    assert [c[2] for c in log.calls] == [min(7, len(long_) - s) for s in range(0, len(long_), 7)]
    rest = serve(core)
    for rid, ids, q in (("a", short, params(0.0, 60)), ("b", long_, params(0.0, 30))):
        assert_same(tiny_bundle, ids, alone(engine, ids, q), rest[rid][-1])


def test_one_budget_of_prompt_tokens_per_step(engine):
    """With P = 10, a 25-token prompt and a 3-token one that joins with it: the first, older, is cut at
    0, 10 and 20; the second waits for a step with room left for it (the third); no step runs more."""
    core = engine.core("fixed", prefill_chunk=10)
    core.add_request("a", engine.encode(LONG)[:25], params(0.0, 4))
    core.add_request("c", [5, 6, 7], params(0.0, 4))
    per_step = []
    with PrefillLog(engine.backend) as log:
        while core.has_unfinished():
            before = len(log.calls)
            core.step()
            per_step.append(log.calls[before:])
    assert per_step[:3] == [[(0, 0, 10)], [(0, 10, 10)], [(0, 20, 5), (1, 0, 3)]]
    assert all(sum(c[2] for c in calls) <= 10 for calls in per_step)


def test_prompt_rows_the_drafter_missed_wait_for_it(engine):
    """A prompt whose first chunk came while the drafter was skipped is not fed to the drafter in its
    later chunks either (that would leave a hole): every row waits for the first drafting round, as
    a whole prompt deferred at join does, and the sampled output is that one's."""
    ids, q = engine.encode(LONG), params(1.0, 30, seed=6)
    outs = {}
    for chunk in (7, None):
        core = engine.core("fixed", prefill_chunk=chunk)
        core.add_request(chunk, ids, q)
        core.history.undrafted = 1  # as after a skipped step: the first chunk is not fed
        core.step()
        core.history.undrafted = 0  # the drafter runs again while the prompt prefills
        while core.slots[0].prefilling:
            core.step()
        assert core.slots[0].floor == len(ids) - core.catch_up  # its first round windowed every prompt row
        outs[chunk] = serve(core)[chunk][-1].token_ids
    assert outs[7] == outs[None]


def test_prefix_reuse_gives_the_output_of_a_fresh_engine(tiny_bundle, engine):
    """A request sharing a long prefix with a finished one takes its slot and prefills only the rest
    (greedy and sampled); one that shares nothing reuses nothing."""
    for temperature in (0.0, 1.0):
        core = engine.core("fixed")
        first = engine.encode(LONG)
        core.add_request("first", first, params(temperature, 20, seed=1))
        core.add_request("other", engine.encode(SHORT), params(temperature, 30, seed=2))
        serve(core)
        assert core.kept[0] is not None and len(core.kept[0].tokens) == len(first) + 19
        second = first[:-12] + engine.encode("Zoo keeper?", chat=False)  # shares n - 12 prompt tokens
        q = params(temperature, 30, seed=4)
        core.add_request("second", second, q)
        with PrefillLog(engine.backend) as log:
            got = serve(core)["second"][-1]
        assert got.stats.cached_tokens == len(first) - 12 >= 16
        assert log.calls == [(0, len(first) - 12, len(second) - len(first) + 12)]  # only the rest, in slot 0
        assert_same(tiny_bundle, second, alone(engine, second, q), got, sampled=temperature > 0)
        unrelated = engine.encode("Zebra " * 4, chat=False)
        core.add_request("unrelated", unrelated, q)
        assert serve(core)["unrelated"][-1].stats.cached_tokens == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_follow_up_turn_reuses_the_previous_turn(tiny_bundle, engine, temperature):
    """Turn 2 = turn 1's prompt + its answer + a new user message: it reuses turn 1's committed rows
    up to where the drafter had been fed (the last verified rows are recomputed for it) and answers
    as a fresh prefill of the whole conversation does."""
    core = engine.core("fixed", prefill_chunk=16)
    turn1 = engine.encode(LONG)
    core.add_request(1, turn1, params(temperature, 24, seed=1))
    answer = serve(core)[1][-1].token_ids
    turn2 = turn1 + answer + engine.encode("And then?")
    q = params(temperature, 24, seed=2)
    core.add_request(2, turn2, q)
    got = serve(core)[2][-1]
    kept = len(turn1) + len(answer) - 1  # the last answer token was never run through the target
    assert len(turn1) < got.stats.cached_tokens <= kept
    assert kept - got.stats.cached_tokens <= engine.backend.block_size + 1  # at most one verification's rows
    assert_same(tiny_bundle, turn2, alone(engine, turn2, q), got, sampled=temperature > 0)


def test_target_alone_reuses_every_committed_row(tiny_bundle, engine):
    """Without a drafter nothing holds the prefix back: the reuse is every committed row."""
    core = engine.core("none")
    turn1 = engine.encode(LONG)
    core.add_request(1, turn1, params(0.0, 24))
    answer = serve(core)[1][-1].token_ids
    turn2 = turn1 + answer + engine.encode("And then?")
    core.add_request(2, turn2, params(0.0, 24))
    got = serve(core)[2][-1]
    assert got.stats.cached_tokens == len(turn1) + len(answer) - 1
    assert_same(tiny_bundle, turn2, alone(engine, turn2, params(0.0, 24), "none"), got)


def test_aborted_requests_keep_what_they_committed(tiny_bundle, engine):
    """Aborted mid-prefill, a slot keeps the chunks prefilled so far; aborted mid-generation, its
    prompt and the tokens run through the target (not the last one, the next anchor). Requests
    that continue them reuse exactly that and answer as on a fresh engine."""
    core = engine.core("fixed", prefill_chunk=16)
    ids = engine.encode(LONG)
    core.add_request("a", ids, params(0.0, 40))
    core.step()
    core.step()
    assert core.slots[0].prefilling and core.slots[0].start == 32
    core.abort_request("a")
    assert len(core.kept[0].tokens) == 32 and core.kept[0].drafter == (0, 32)
    core.add_request("b", ids, params(0.0, 40))
    b = []
    while len(b) < 20:
        b = next((o.token_ids for o in core.step() if o.request_id == "b"), b)
    assert core.slots[0].stats.cached_tokens == 32
    aborted = core.abort_request("b")
    assert len(core.kept[0].tokens) == len(ids) + len(aborted.token_ids) - 1
    c = ids + aborted.token_ids + engine.encode("More.")
    core.add_request("c", c, params(0.0, 30))
    got = serve(core)["c"][-1]
    assert len(ids) < got.stats.cached_tokens <= len(ids) + len(aborted.token_ids) - 1
    assert_same(tiny_bundle, c, alone(engine, c, params(0.0, 30)), got)  # other cores after this one's steps
    ref = alone(engine, ids, params(0.0, 40))
    m = greedy_match(ref.token_ids[:len(aborted.token_ids)], aborted.token_ids,
                     reference_logits(tiny_bundle.target, ids, ref.token_ids))
    assert m.ok, m


def test_kept_prefix_survives_dummy_rows(tiny_bundle, engine):
    """x finishes in slot 0 while y runs on in slot 1, so slot 0 rides along as a dummy row of every
    batched call; those rows start where x's kept rows end, so z, continuing x, still reuses them."""
    core = engine.core("fixed")
    x = engine.encode(LONG)
    core.add_request("x", x, params(0.0, 4))
    core.add_request("y", engine.encode(SHORT), params(0.0, 80))
    out = serve(core, until=lambda: "x" not in core.requests)
    assert core.kept[0] is not None and "y" in core.requests
    for _ in range(5):
        core.step()  # dummy rows of slot 0
    z = x + out["x"][-1].token_ids + engine.encode("Go on.")
    core.add_request("z", z, params(0.0, 30))
    got = serve(core)["z"][-1]
    assert got.stats.cached_tokens > len(x)
    assert_same(tiny_bundle, z, alone(engine, z, params(0.0, 30)), got)


def test_reuse_under_the_cost_scheduler_stays_lossless(tiny_bundle, profiled, engine):
    """With a dear drafter, `cost` skips it, defers joins and windows contexts, so kept drafter
    contexts start at a floor: two conversations of three turns on two slots, chunked, reuse their
    turns and give the target alone's greedy output."""
    from factories import TINY_SPS

    from dspark.runtime import SpsTable
    from dspark.runtime.schedulers import make_scheduler

    dear = make_scheduler("cost", sps=SpsTable(TINY_SPS.sps, (1.0, 1.2, 1.4)), calibration=engine.calibration)
    core = EngineCore(engine.backend, dear, catch_up=engine.backend.block_size + 1, prefill_chunk=9)
    prompts = {0: engine.encode(LONG), 1: engine.encode(LONG.lower())}
    results = []
    for turn in range(3):
        for conv in (0, 1):
            core.add_request((conv, turn), prompts[conv], params(0.0, 20))
        outs = serve(core)
        for conv in (0, 1):
            got = outs[(conv, turn)][-1]
            results.append((prompts[conv], got))
            prompts[conv] = prompts[conv] + got.token_ids + engine.encode(f"Turn {turn}?")
    assert sum(got.stats.cached_tokens > 0 for _, got in results) >= 4
    assert not all(all(got.stats.drafted) for _, got in results), "the drafter should have been skipped"
    for ids, got in results:
        ref = alone(engine, ids, params(0.0, 20), "none")
        m = greedy_match(ref.token_ids, got.token_ids, reference_logits(tiny_bundle.target, ids, ref.token_ids))
        assert m.ok, m


def test_reuse_rules(engine):
    """Where a prefill starts and its drafter floor, from a kept slot: the shared prefix, cut back to
    the end of the drafter's kept context (whose floor the request takes), or with no drafter context
    left, restarted at the prefix; never the last prompt token; nothing under min_prefix."""
    from dspark.runtime.core import _Kept

    kept = np.arange(10, 50)  # [40]
    prompt = np.concatenate([kept[:30], [99, 98]])  # shares 30

    def reuse(drafter, scheduler="fixed", prompt=prompt, min_prefix=16):
        core = engine.core(scheduler, min_prefix=min_prefix)
        core.kept[1] = _Kept(kept, drafter)
        return core._reuse(1, prompt)

    assert reuse((0, 40)) == (30, 0)  # the drafter holds the whole prefix
    assert reuse((0, 25)) == (25, 0)  # target rows 25..29 rerun to feed the drafter
    assert reuse((8, 36)) == (30, 8)  # a windowed context: its floor
    assert reuse((20, 20)) == (30, 30)  # nothing fed since the window: the context restarts at 30
    assert reuse((0, 10)) == (0, 0)  # 10 < min_prefix
    assert reuse((0, 10), min_prefix=10) == (10, 0)
    assert reuse((0, 0), "none") == (30, 30)  # the target alone: every shared row
    assert reuse((0, 40), prompt=kept[:20]) == (19, 0)  # a prompt the slot holds whole: its last token runs
    assert engine.core("fixed")._reuse(0, prompt) == (0, 0)  # nothing kept
    with pytest.raises(InputError, match="prefill_chunk is 0"):
        engine.core("fixed", prefill_chunk=0)


def test_a_core_forgets_prefixes_another_core_overwrote(tiny_bundle, engine):
    """Cores over one backend take turns: after another core's step (here Engine.generate's), a core's
    kept prefixes may be overwritten, so it reuses none of them and its output stays right."""
    core = engine.core("fixed")
    ids = engine.encode(LONG)
    core.add_request("a", ids, params(0.0, 10))
    serve(core)
    assert core.kept[0] is not None
    engine.generate("Something else entirely, and long enough.", max_new_tokens=10)  # its own core, slot 0
    core.add_request("b", ids, params(0.0, 20))
    got = serve(core)["b"][-1]
    assert got.stats.cached_tokens == 0
    assert_same(tiny_bundle, ids, alone(engine, ids, params(0.0, 20)), got)


class NoPrefix:
    """A backend whose prefill takes whole prompts only (no `supports_prefix`)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        for name in ("block_size", "vocab_size", "max_seq", "slots", "accepts_on_device", "drafter_graph", "on_run"):
            setattr(self, name, getattr(inner, name))

    def prefill(self, slot, tokens, ingest):
        self.calls.append(len(tokens))
        return self.inner.prefill(slot, tokens, ingest)

    def target(self, tokens, starts):
        return self.inner.target(tokens, starts)

    def draft(self, batch):
        return self.inner.draft(batch)

    def verify(self, batch, draft):
        return self.inner.verify(batch, draft)


def test_backend_without_prefix_support_gets_whole_prompts(tiny_bundle, engine):
    backend = NoPrefix(engine.backend)
    core = EngineCore(backend, FixedLength(), prefill_chunk=7, min_prefix=1)
    assert core.prefill_chunk is None and core.min_prefix is None
    ids = engine.encode(LONG)
    for rid in "ab":  # b could reuse all of a's prompt
        core.add_request(rid, ids, params(0.0, 20))
        got = serve(core)[rid][-1]
        assert got.stats.cached_tokens == 0
    assert backend.calls == [len(ids)] * 2
    ref = generate_batch(engine.backend, [Request(ids, params(0.0, 20))], FixedLength(), prefill_chunk=None)[0]
    assert got.token_ids == ref.token_ids


# --- the shared GPU layer, on the CPU TorchDevice (not run on a GPU) ---------------------------------

GPU_PROMPTS = [list(range(20, 44)), list(range(50, 71)), [5, 6, 7, 8, 9, 10], list(range(30, 52))]


@pytest.fixture(scope="module")
def models(one_torch_thread):
    target = tiny_target("llama", seed=3)
    return target, copy_drafter(target, block_size=4)


def test_gpu_layer_chunks_and_reuse(models):
    """Four slots: four requests join, prefilled 7 tokens a step (in the layer's own calls of at most 5
    rows); slot 3's finishes first, then slots 0..2 run as a batch padded to the bucket of 4, so slot
    3 is a padding row; then a fifth request continues slot 3's conversation there. Greedy and
    sampled outputs are the PyTorch reference's solo runs."""
    from dspark.export import TorchBackend
    from dspark.export.cuda_graph_backend import cuda_graph_backend

    target, drafter = models
    be = cuda_graph_backend(target, drafter, 128, device="cpu", prefill_chunk=5, min_context=8, slots=4)
    for temperature in (0.0, 1.0):
        core = EngineCore(be, FixedLength(), prefill_chunk=7)
        budgets = [60, 60, 60, 6]
        for rid, (ids, n) in enumerate(zip(GPU_PROMPTS, budgets)):
            core.add_request(rid, ids, params(temperature, n, seed=rid))
        outs = serve(core, until=lambda: 3 not in core.requests)
        for _ in range(3):
            core.step()  # slot 3 pads the batch of slots 0..2
        assert all(r is not None and r.finish_reason is None for r in core.slots[:3]) and core.slots[3] is None
        prompts = {**dict(enumerate(GPU_PROMPTS)), 4: GPU_PROMPTS[3] + outs[3][-1].token_ids + [60, 61, 62]}
        core.add_request(4, prompts[4], params(temperature, 20, seed=4))
        outs = {rid: o[-1] for rid, o in (outs | serve(core)).items()}
        assert outs[4].stats.cached_tokens >= len(GPU_PROMPTS[3]) and core.kept[3] is not None
        for rid, n in zip(range(5), [*budgets, 20]):
            q, ids = params(temperature, n, seed=rid), prompts[rid]
            ref = generate_batch(TorchBackend(target, drafter, 128), [Request(ids, q)], FixedLength())[0]
            if temperature:
                assert outs[rid].token_ids == ref.token_ids, rid
            else:
                m = greedy_match(ref.token_ids, outs[rid].token_ids, reference_logits(target, ids, ref.token_ids))
                assert m.ok, f"{rid}: {m}"
