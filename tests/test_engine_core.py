"""The step-wise engine core (runtime/core.py) on the tiny bundle: requests join between steps and
take free slots, an aborted request frees its slot for the next step, and none of this changes
another request's output. Bad calls are typed errors and the core keeps serving."""
from __future__ import annotations

import numpy as np
import pytest
from factories import Replay, reference_logits

from dspark.runtime import Engine, EngineFullError, InputError, SamplingParams, UnknownRequestError, generate
from dspark.runtime.tools.parity import greedy_match

SLOTS = 3
MAX_SEQ = 160


@pytest.fixture(scope="module")
def engines(profiled):
    """One request at a time and SLOTS at a time, the same (fp32) drafter graph for sampled rows."""
    return (Engine.load(profiled, max_seq=MAX_SEQ, drafter_graph="fp32"),
            Engine.load(profiled, max_seq=MAX_SEQ, slots=SLOTS, drafter_graph="fp32"))


def run(core, outputs: dict, until=lambda: False) -> int:
    """Step until `until()` or nothing is left; collect each request's outputs. Returns the steps run."""
    steps = 0
    while core.has_unfinished() and not until():
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
        steps += 1
    return steps


def test_join_abort_and_reuse_under_the_cost_scheduler(tiny_bundle, engines):
    """Three requests start (one sampled with a seed); after 3 steps a fourth is added and waits for
    a slot; the third is aborted halfway and the fourth takes its slot at the next step. The
    others' outputs are those of their solo runs: the greedy ones identical (in the floating-point
    sense of dspark.md §1), the sampled one token for token under the decisions it met (`Replay`:
    under `cost` a request's ℓ depends on the batch by design, which changes how a sampled request
    uses its draws, never their distribution)."""
    solo, batch = engines
    core = batch.core("cost")
    prompts = {"a": "Hello there, how are you?", "b": "Tell me a story about a dragon.", "c": "abc def ghi jkl mno pqr",
               "d": "What is 17 * 23?"}
    params = {"a": batch.params(0.0, 40), "b": batch.params(1.0, 40, seed=5), "c": batch.params(0.0, 40),
              "d": batch.params(0.0, 30)}
    for rid in "abc":
        core.add_request(rid, batch.encode(prompts[rid]), params[rid])
    outputs: dict[str, list] = {}
    assert run(core, outputs, until=lambda: len(outputs.get("a", [])) >= 3) == 3
    slot_of_c = next(s for s, r in enumerate(core.slots) if r is not None and r.request_id == "c")
    core.add_request("d", batch.encode(prompts["d"]), params["d"])
    assert core.running == SLOTS and len(core.waiting) == 1  # all slots busy: d waits

    def c_halfway() -> bool:
        return len(outputs["c"][-1].token_ids) >= params["c"].max_new_tokens // 2

    run(core, outputs, until=c_halfway)
    assert all(not o.finished for o in outputs["a"] + outputs["b"]), "a and b must still be mid-generation"
    aborted = core.abort_request("c")
    assert aborted.finish_reason == "abort" and 20 <= len(aborted.token_ids) < 40
    assert core.running == SLOTS - 1 and len(core.waiting) == 1  # freed now, d joins at the next step
    core.step()
    assert core.slots[slot_of_c] is not None and core.slots[slot_of_c].request_id == "d"  # the slot is reused
    run(core, outputs)
    assert not core.has_unfinished()

    final = {rid: outs[-1] for rid, outs in outputs.items()}
    assert set(final) == set("abcd") and all(final[r].finished for r in "abd")
    for rid in "ad":
        ids = solo.encode(prompts[rid])
        alone = generate(solo.backend, ids, params[rid], solo.scheduler("cost"))
        m = greedy_match(alone.token_ids, final[rid].token_ids, reference_logits(tiny_bundle.target, ids, alone.token_ids))
        assert m.ok, f"{rid}: {m}"
    assert max(final["a"].stats.batch) == SLOTS and min(final["d"].stats.batch) < SLOTS
    alone_b = generate(solo.backend, solo.encode(prompts["b"]), params["b"], Replay(final["b"].stats))
    assert alone_b.token_ids == final["b"].token_ids
    assert len(set(final["b"].stats.verified)) > 1, "cost should vary b's verified length"
    ids_c = solo.encode(prompts["c"])  # what c made before its abort is its solo run's beginning
    alone_c = generate(solo.backend, ids_c, params["c"], solo.scheduler("cost"))
    got_c = aborted.token_ids
    m = greedy_match(alone_c.token_ids[:len(got_c)], got_c, reference_logits(tiny_bundle.target, ids_c, alone_c.token_ids))
    assert m.ok, f"c: {m}"


def test_outputs_stream_the_committed_tokens(engines):
    """Each step's new tokens, concatenated, are the request's tokens; the last output says why it ended."""
    _, batch = engines
    core = batch.core("fixed")
    core.add_request(0, batch.encode("Hi"), batch.params(0.0, 17))
    outputs: dict[int, list] = {}
    run(core, outputs)
    outs = outputs[0]
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
    assert outs[-1].finish_reason in ("stop", "length") and not any(o.finished for o in outs[:-1])
    assert all(o.new_token_ids for o in outs)


def test_bad_calls_are_typed_errors_and_the_core_keeps_serving(engines):
    _, batch = engines
    core = batch.core("fixed", max_waiting=1)
    ids = batch.encode("Hi")
    for rid in range(SLOTS + 1):  # SLOTS join at the first step; one more may wait
        core.add_request(rid, ids, batch.params(0.0, 8))
        if rid < SLOTS:
            assert len(core.waiting) == rid + 1
    with pytest.raises(EngineFullError, match="retry later"):
        core.add_request("late", ids, batch.params(0.0, 8))
    core.step()  # SLOTS joined; one still waits
    with pytest.raises(EngineFullError):
        core.add_request("late", ids, batch.params(0.0, 8))
    assert core.abort_request(SLOTS).token_ids == []  # a waiting request aborts too: the queue has room again
    core.add_request("late", ids, batch.params(0.0, 8))
    with pytest.raises(InputError, match="already waiting or running"):
        core.add_request("late", ids, batch.params(0.0, 8))
    with pytest.raises(UnknownRequestError, match="no request 'nobody'"):
        core.abort_request("nobody")
    with pytest.raises(InputError, match="prompt is empty"):
        core.add_request("empty", [], batch.params(0.0, 8))
    with pytest.raises(InputError, match="token ids outside"):
        core.add_request("oov", [batch.backend.vocab_size], batch.params(0.0, 8))
    with pytest.raises(InputError, match="exceeds the context"):
        core.add_request("long", ids, batch.params(0.0, MAX_SEQ))
    assert "empty" not in core.requests and "long" not in core.requests  # nothing half-added
    outputs: dict = {}
    run(core, outputs)
    assert set(outputs) == {*range(SLOTS), "late"} and all(o[-1].finished for o in outputs.values())
    with pytest.raises(UnknownRequestError):
        core.abort_request("late")  # finished requests are gone


@pytest.mark.parametrize("field,value,message", [
    ("seed", -5, "seed is -5, expected an integer >= 0"),
    ("seed", 1.5, "seed is 1.5"),
    ("temperature", -1.0, "temperature is -1.0"),
    ("max_new_tokens", 0, "max_new_tokens is 0, expected >= 1"),
    ("stop", ("",), "stop is"),
    ("stop", "abc", "stop is"),
    ("stop_token_ids", (-1,), "stop_token_ids is"),
])
def test_sampling_params_are_checked_once(field, value, message):
    with pytest.raises(InputError, match=message):
        SamplingParams(**{field: value})


def test_one_request_alone_is_the_same_through_any_driver(engines):
    """Engine.generate, the core driven by hand, and generate() give the same tokens."""
    solo, _ = engines
    params = solo.params(1.0, 20, seed=3)
    ids = solo.encode("Tell me a story about a dragon.")
    via_engine = solo.generate("Tell me a story about a dragon.", max_new_tokens=20, temperature=1.0, seed=3,
                               scheduler="prefix")
    core = solo.core("prefix")
    core.add_request("x", ids, params)
    outputs: dict = {}
    run(core, outputs)
    via_generate = generate(solo.backend, ids, params, solo.scheduler("prefix"))
    assert via_engine.token_ids == outputs["x"][-1].token_ids == via_generate.token_ids
    np.testing.assert_array_equal(via_engine.stats.verified, via_generate.stats.verified)
