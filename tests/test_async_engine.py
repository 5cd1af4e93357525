"""AsyncEngine (runtime/async_engine.py) on the tiny bundle: outputs as Engine.generate's, stop
strings cut the same way, a consumer that leaves or abort() frees the slot within one step, bad
requests and a full queue are raised before any output, a failing step fails its requests, and
the engine keeps serving after each of these."""
from __future__ import annotations

import asyncio
import time

import pytest

from dspark.runtime import AsyncEngine, Engine, EngineError, EngineFullError, InputError, UnknownRequestError
from dspark.runtime.async_engine import collect

PROMPT = "Hello there, how are you?"
TIMEOUT = 30  # s: every wait is bounded


@pytest.fixture(scope="module")
def reference(tiny_bundle):
    return Engine.load(tiny_bundle.path, threads=1)


@pytest.fixture
def engine(tiny_bundle):
    """One slot, nobody waits: a second request while one runs is refused."""
    with AsyncEngine.load(tiny_bundle.path, slots=1, max_waiting=0, scheduler="fixed", threads=1) as e:
        yield e


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def wait_idle(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + TIMEOUT
    while (s := engine.state()).running or s.waiting:
        assert time.monotonic() < deadline, f"the engine did not go idle: {s}"
        time.sleep(0.01)


def long_params(engine: AsyncEngine, prompt: str = PROMPT):
    """Greedy up to the end of the context: the tiny model never stops early on PROMPT (about 100 steps)."""
    return engine.params(0.0, engine.room(len(engine.engine.encode(prompt))))


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0, max_new_tokens=40),
                                    dict(temperature=1.0, max_new_tokens=40, seed=7),
                                    dict(temperature=0.0, max_new_tokens=40, stop=["((("]),
                                    dict(temperature=1.0, max_new_tokens=40, seed=3, stop=["j", "xyz"])])
def test_outputs_are_engine_generates(engine, reference, kwargs):
    expected = reference.generate(PROMPT, scheduler="fixed", **kwargs)
    got = engine.generate_sync(PROMPT, engine.params(**kwargs))
    assert (got.text, got.token_ids, got.finish_reason) == (expected.text, expected.token_ids, expected.finish_reason)
    assert got.prompt_tokens == expected.prompt_tokens and got.stats.tau == expected.stats.tau

    async def pieces():  # the stream: text only ever grows, never past a stop string
        return [o async for o in engine.generate(PROMPT, engine.params(**kwargs))]

    outs = run(pieces())
    assert "".join(o.text for o in outs) == expected.text
    assert [t for o in outs for t in o.token_ids] == expected.token_ids
    assert [o.finish_reason for o in outs][-1] == expected.finish_reason and outs[-1].stats is not None


def test_token_ids_and_messages_are_prompts(engine, reference):
    ids = reference.encode(PROMPT)
    by_ids = engine.generate_sync(ids, engine.params(0.0, 12))
    by_messages = engine.generate_sync([{"role": "user", "content": PROMPT}], engine.params(0.0, 12))
    raw = engine.generate_sync(PROMPT, engine.params(0.0, 12), chat=False)
    expected = reference.generate(PROMPT, max_new_tokens=12, scheduler="fixed").token_ids
    assert by_ids.token_ids == by_messages.token_ids == expected
    assert raw.token_ids == reference.generate(PROMPT, max_new_tokens=12, chat=False, scheduler="fixed").token_ids


def test_leaving_early_frees_the_slot_within_one_step(engine):
    async def leave_after_first_output():
        outputs = engine.generate(PROMPT, long_params(engine))
        first = await anext(outputs)
        steps = engine.state().steps
        await outputs.aclose()  # what a cancelled consumer or a closed connection does
        return first, steps

    first, steps = run(leave_after_first_output())
    assert first.finish_reason is None
    wait_idle(engine)
    s = engine.state()
    assert s.finished == {"abort": 1}, s.finished
    assert s.steps - steps <= 1, f"{s.steps - steps} steps ran after the consumer left"
    assert engine.generate_sync("Hi", engine.params(0.0, 8)).finish_reason in ("stop", "length")


def test_cancelled_consumer_aborts(engine):
    async def cancel_midway():
        got = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPT, long_params(engine)):
                got.set()

        task = asyncio.create_task(consume())
        await got.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_midway())
    wait_idle(engine)
    assert engine.state().finished == {"abort": 1}


def test_abort_ends_the_stream(engine):
    async def abort_midway():
        outs = []
        async for out in engine.generate(PROMPT, long_params(engine), request_id="victim"):
            outs.append(out)
            if len(outs) == 1:
                engine.abort("victim")
        return outs

    outs = run(abort_midway())
    assert outs[-1].finish_reason == "abort" and all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].completion_tokens < long_params(engine).max_new_tokens
    with pytest.raises(UnknownRequestError):
        engine.abort("victim")  # ended
    assert engine.generate_sync("Hi", engine.params(0.0, 8)).token_ids


def test_bad_requests_and_a_full_queue_raise_before_any_output(engine, reference):
    def first_output(prompt, params, request_id=None):
        async def first():
            async for out in engine.generate(prompt, params, request_id):
                return out
        return run(first())

    with pytest.raises(InputError, match="prompt is empty"):
        first_output([], engine.params(0.0, 8))
    with pytest.raises(InputError, match="exceeds the context"):
        first_output(PROMPT, engine.params(0.0, engine.room(len(reference.encode(PROMPT))) + 1))
    with pytest.raises(InputError, match="token ids outside"):
        first_output([reference.backend.vocab_size], engine.params(0.0, 8))

    async def while_one_runs():
        outputs = engine.generate(PROMPT, long_params(engine), request_id="busy")
        first = await anext(outputs)  # running in the only slot
        with pytest.raises(InputError, match="already waiting or running"):
            await anext(engine.generate("Hi", engine.params(0.0, 8), request_id="busy"))
        with pytest.raises(EngineFullError, match="retry later"):
            await anext(engine.generate("Hi", engine.params(0.0, 8)))
        rest = await collect(outputs)
        return first.text + rest.text, rest.finish_reason

    text, finish_reason = run(while_one_runs())  # the refusals did not disturb the running request
    assert finish_reason == "length"
    assert text == reference.generate(PROMPT, max_new_tokens=long_params(engine).max_new_tokens, scheduler="fixed").text
    assert engine.state().rejected == 1
    assert engine.generate_sync(PROMPT, engine.params(0.0, 16)).token_ids == reference.generate(
        PROMPT, max_new_tokens=16, scheduler="fixed").token_ids


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(tiny_bundle, reference, monkeypatch):
    with AsyncEngine.load(tiny_bundle.path, slots=2, scheduler="fixed", threads=1) as engine:
        backend = engine.engine.backend
        draft = backend.draft
        failed = []

        def fails_once(batch):  # the first drafting call over both slots raises, as a broken backend would
            if len(batch.anchors) == 2 and not failed:
                failed.append(True)
                raise RuntimeError("device lost")
            return draft(batch)

        monkeypatch.setattr(backend, "draft", fails_once)

        async def two():
            return await asyncio.gather(*(collect(engine.generate(p, long_params(engine, p))) for p in (PROMPT, "Hi")),
                                        return_exceptions=True)

        results = run(two())
        assert all(isinstance(r, EngineError) and "device lost" in str(r) for r in results), results
        assert engine.state().finished == {"error": 2} and engine.alive
        assert engine.generate_sync(PROMPT, engine.params(0.0, 16)).token_ids == reference.generate(
            PROMPT, max_new_tokens=16, scheduler="fixed").token_ids


def test_shutdown_fails_the_requests_left(tiny_bundle):
    engine = AsyncEngine.load(tiny_bundle.path, slots=1, scheduler="fixed", threads=1)

    async def shut_down_midway():
        outputs = engine.generate(PROMPT, long_params(engine))
        await anext(outputs)
        engine.shutdown()
        with pytest.raises(EngineError, match="shut down"):
            async for _ in outputs:
                pass
        with pytest.raises(EngineError, match="shut down"):
            await anext(engine.generate("Hi", engine.params(0.0, 8)))

    run(shut_down_midway())
    assert not engine.alive


def test_serving_prefills_in_smaller_chunks_than_batch_work(tiny_bundle):
    """AsyncEngine and `dspark serve` default to SERVE_PREFILL_CHUNK (the streams' ITL p99, docs/results.md);
    Engine.load keeps the batch default, and an explicit value, None (whole prompts) included, wins."""
    from dspark.runtime.core import PREFILL_CHUNK, SERVE_PREFILL_CHUNK
    from dspark.runtime.tools.cli import build_parser

    assert SERVE_PREFILL_CHUNK < PREFILL_CHUNK
    assert Engine.load(tiny_bundle.path, threads=1).prefill_chunk == PREFILL_CHUNK
    for kwargs, chunk in [({}, SERVE_PREFILL_CHUNK), ({"prefill_chunk": 7}, 7), ({"prefill_chunk": None}, None)]:
        with AsyncEngine.load(tiny_bundle.path, slots=1, threads=1, **kwargs) as e:
            assert e.engine.prefill_chunk == chunk
            assert e._core.prefill_chunk == chunk
    assert build_parser().parse_args(["serve", "--bundle", "b"]).prefill_chunk == SERVE_PREFILL_CHUNK
