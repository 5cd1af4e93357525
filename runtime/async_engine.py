"""AsyncEngine: one `EngineCore` driven by one background thread, for asyncio callers.

    engine = AsyncEngine.load("engines/smollm2", slots=4, max_waiting=64)
    async for out in engine.generate("What is 17 * 23?", engine.params(max_new_tokens=128)):
        print(out.text, end="")
    engine.shutdown()

The engine thread owns the core; no other thread calls it. `generate` checks a request on the
caller's thread (an InputError or EngineFullError is raised before any output) and queues an add
command; leaving the `async for` early (break, cancellation, a closed connection) or `abort(id)`
queues an abort. Before every step the thread applies the queued commands, so a new request joins
at the next step and an aborted one frees its slot for it. The thread steps while any request is
unfinished and sleeps on a condition otherwise. It detokenizes each request's new tokens, ends a
request at a stop string as `Engine.generate` does (the text ends before it; the request is
aborted in the core), and hands the outputs to the caller's event loop (`call_soon_threadsafe`).
A step that raises fails the requests in the core with an `EngineError` and the thread goes on
with a fresh core."""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .core import (SERVE_PREFILL_CHUNK, EngineCore, EngineFullError, RequestOutput, UnknownRequestError,
                   check_prompt, room)
from .engine import Engine, Prompt, Result, TextStream, cut_at_stop
from .errors import InputError
from .request import SamplingParams, Stats

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request could not finish: a step failed, or the engine shut down."""


@dataclass
class StreamOutput:
    """What one step did for one request, as its caller sees it."""

    request_id: str
    text: str  # new text since the previous output (a possible start of a stop string is held back)
    token_ids: list[int]  # tokens committed in this step (after a stop string too, as in Result.token_ids)
    prompt_tokens: int
    completion_tokens: int  # tokens generated so far
    finish_reason: str | None = None  # None while running; "stop" (a stop token) | "stop_string" | "length" | "abort"
    stats: Stats | None = None  # on the last output


@dataclass
class EngineState:
    """Counters for metrics (running and waiting as of the last step)."""

    slots: int
    max_waiting: int | None
    running: int = 0  # requests in a slot
    waiting: int = 0  # requests accepted and not yet in a slot
    steps: int = 0
    rejected: int = 0  # requests refused with EngineFullError
    # accepted requests that ended, by reason: stop, stop_string, length, abort, error
    finished: dict[str, int] = field(default_factory=dict)
    generated_tokens: int = 0
    # the speculation of the requests that ended (their Stats, summed)
    cycles: int = 0
    drafted_cycles: int = 0  # cycles in which the drafter ran
    verified: int = 0  # Σ ℓ over cycles
    emitted: int = 0  # Σ τ over cycles
    attempts: list[int] = field(default_factory=list)  # [γ] per draft position, as Stats.attempts
    accepts: list[int] = field(default_factory=list)  # [γ]

    def end(self, reason: str, stats: Stats | None) -> None:
        """Count a request that ended."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if stats is None:
            return
        self.cycles += stats.cycles
        self.drafted_cycles += int(sum(stats.drafted))
        self.verified += int(sum(stats.verified))
        self.emitted += int(sum(stats.emitted))
        if stats.attempts is not None:
            self.attempts = [int(a + b) for a, b in zip(self.attempts, stats.attempts)]
            self.accepts = [int(a + b) for a, b in zip(self.accepts, stats.accepts)]


@dataclass(eq=False)
class _Stream:
    """A request between the engine thread and its caller."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # StreamOutput | EngineError, in order
    text: TextStream
    prompt_tokens: int
    added: bool = False  # in the core
    sent: int = 0  # characters of text.text handed out

    def take(self, stopped: bool, final: bool) -> str:
        """The text not handed out yet: up to a stop string, or all of it when the request ends, or all
        but a suffix that may begin a stop string."""
        text, stop = self.text.text, self.text.stop
        end = len(cut_at_stop(text, stop)) if stopped else len(text) if final else len(text) - _stop_prefix(text, stop)
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return piece


def _stop_prefix(text: str, stop: Sequence[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class AsyncEngine:
    def __init__(self, engine: Engine, scheduler: str = "auto", threshold: float = 0.5,
                 max_waiting: int | None = None):
        """Serve `engine` (Engine.load(..., slots=N)) from a new engine thread. max_waiting: requests
        that may wait for a slot when all are busy (None: no limit)."""
        if max_waiting is not None and max_waiting < 0:
            raise InputError(f"max_waiting is {max_waiting}, expected >= 0")
        self.engine, self.max_waiting = engine, max_waiting
        self.slots = engine.backend.slots
        self._new_core: Callable[[], EngineCore] = lambda: engine.core(scheduler, threshold)
        self._core = self._new_core()  # engine thread only (once the thread runs)
        self._cond = threading.Condition()  # guards everything below
        self._streams: dict[str, _Stream] = {}  # accepted and not ended
        self._commands: list[Callable[[], None]] = []  # for the engine thread, in order
        self._closed = False
        gamma = engine.backend.block_size
        self._state = EngineState(self.slots, max_waiting, attempts=[0] * gamma, accepts=[0] * gamma)
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, bundle: str | Path, slots: int = 1, max_waiting: int | None = None, scheduler: str = "auto",
             threshold: float = 0.5, **load_kwargs) -> "AsyncEngine":
        """Engine.load(bundle, slots=slots, **load_kwargs) (max_seq, backend, provider, threads,
        target_graph, drafter_graph, prefill_chunk, min_prefix), served by a new engine thread.
        prefill_chunk defaults to SERVE_PREFILL_CHUNK (core.py), not the batch default."""
        load_kwargs.setdefault("prefill_chunk", SERVE_PREFILL_CHUNK)
        return cls(Engine.load(bundle, slots=slots, **load_kwargs), scheduler, threshold, max_waiting)

    def params(self, temperature: float = 0.0, max_new_tokens: int = 256, seed: int = 0,
               stop: Sequence[str] = ()) -> SamplingParams:
        """SamplingParams with the bundle's stop tokens (Engine.params)."""
        return self.engine.params(temperature, max_new_tokens, seed, stop)

    def room(self, prompt_tokens: int) -> int:
        """The largest max_new_tokens a prompt of this many tokens may ask for (core.room)."""
        return room(self.engine.backend, prompt_tokens)

    # -- callers' side (any thread with an event loop) --

    async def generate(self, prompt: Prompt | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *, chat: bool = True) -> AsyncIterator[StreamOutput]:
        """Serve one request, yielding its outputs as steps commit them; the last one has a finish
        reason and the Stats. `prompt`: a user message (in the chat template unless chat=False), chat
        messages, or token ids. params default: greedy, 256 tokens, the bundle's stop tokens.
        Raises InputError (bad request, duplicate id) or EngineFullError before any output, and
        EngineError if the engine fails the request. Leaving early aborts the request."""
        stream = self._accept(prompt, params, request_id, chat)
        ended = False
        try:
            while True:
                out = await stream.queue.get()
                if isinstance(out, EngineError):
                    ended = True
                    raise out
                ended = out.finish_reason is not None
                yield out
                if ended:
                    return
        finally:
            if not ended:
                self._command(lambda: self._abort(stream))

    def generate_sync(self, prompt: Prompt | Sequence[int], params: SamplingParams | None = None,
                      request_id: str | None = None, *, chat: bool = True) -> Result:
        """`generate` to the end, for code without a running event loop: the same Result as
        Engine.generate (finish reason "stop_string" for a stop string)."""
        return asyncio.run(collect(self.generate(prompt, params, request_id, chat=chat)))

    def abort(self, request_id: str) -> None:
        """End an accepted request at the next step: its caller gets a last output with finish reason
        "abort". Raises UnknownRequestError for an id that is not waiting or running."""
        with self._cond:
            stream = self._streams.get(request_id)
        if stream is None:
            raise UnknownRequestError(f"no request {request_id!r} is waiting or running")
        self._command(lambda: self._abort(stream))

    def state(self) -> EngineState:
        with self._cond:
            s = self._state
            return replace(s, waiting=max(0, len(self._streams) - s.running), finished=dict(s.finished),
                           attempts=list(s.attempts), accepts=list(s.accepts))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread after its current step; unfinished requests fail with EngineError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _accept(self, prompt: Prompt | Sequence[int], params: SamplingParams | None, request_id: str | None,
                chat: bool) -> _Stream:
        params = self.params() if params is None else params
        is_ids = not isinstance(prompt, str) and all(isinstance(t, (int, np.integer)) for t in prompt)
        ids = list(prompt) if is_ids else self.engine.encode(prompt, chat)
        check_prompt(self.engine.backend, ids, params)
        request_id = uuid.uuid4().hex if request_id is None else request_id
        stream = _Stream(request_id, asyncio.get_running_loop(), asyncio.Queue(),
                         TextStream(self.engine.tokenizer, params.stop), len(ids))
        with self._cond:
            if self._closed:
                raise EngineError("the engine is shut down")
            if request_id in self._streams:
                raise InputError(f"request {request_id!r} is already waiting or running")
            if self.max_waiting is not None and len(self._streams) >= self.slots + self.max_waiting:
                self._state.rejected += 1
                raise EngineFullError(f"{self.slots} slots are busy and {self.max_waiting} requests wait "
                                      f"(max_waiting); retry later")
            self._streams[request_id] = stream
            self._commands.append(lambda: self._add(stream, ids, params))
            self._cond.notify()
        return stream

    def _command(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # -- the engine thread --

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._commands or self._closed or self._core.has_unfinished())
                if self._closed:
                    break
                commands, self._commands = self._commands, []
            for command in commands:
                self._guarded(command)
            if self._core.has_unfinished():
                self._guarded(self._step)
            with self._cond:
                self._state.running = self._core.running
        self._fail(EngineError("the engine shut down before the request finished"), lambda s: True)

    def _guarded(self, work: Callable[[], None]) -> None:
        """Run `work`; if it raises, the core's state is unknown: fail its requests, go on with a fresh core."""
        try:
            work()
        except Exception as e:
            log.exception("engine step failed")
            self._fail(EngineError(f"an engine step failed: {type(e).__name__}: {e}"), lambda s: s.added)
            self._core = self._new_core()

    def _step(self) -> None:
        with self._cond:
            self._state.steps += 1
        for out in self._core.step():
            self._deliver(out)

    def _add(self, stream: _Stream, ids: list[int], params: SamplingParams) -> None:
        stream.added = True  # before the call: a failing add fails with the core's requests
        self._core.add_request(stream.request_id, ids, params)

    def _abort(self, stream: _Stream) -> None:
        if self._streams.get(stream.request_id) is not stream:  # ended meanwhile (the id may be reused)
            return
        self._deliver(self._core.abort_request(stream.request_id))

    def _deliver(self, out: RequestOutput) -> None:
        """Detokenize a step's output, end the request at a stop string, hand it to its caller."""
        stream = self._streams[out.request_id]
        _, stopped = stream.text.add(out.new_token_ids)
        reason = "stop_string" if stopped else out.finish_reason
        if stopped and not out.finished:
            self._core.abort_request(out.request_id)
        text = stream.take(stopped, final=reason is not None)
        result = StreamOutput(stream.request_id, text, list(out.new_token_ids), stream.prompt_tokens,
                              len(out.token_ids), reason, out.stats if reason else None)
        with self._cond:
            self._state.generated_tokens += len(out.new_token_ids)
            if reason is not None:
                del self._streams[stream.request_id]
                self._state.end(reason, out.stats)
        self._send(stream, result)

    def _fail(self, error: EngineError, which: Callable[[_Stream], bool]) -> None:
        """End the requests `which` selects with `error`."""
        with self._cond:
            streams = [s for s in self._streams.values() if which(s)]
            for s in streams:
                del self._streams[s.request_id]
                self._state.end("error", None)
        for s in streams:
            self._send(s, error)

    def _send(self, stream: _Stream, item: StreamOutput | EngineError) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody listens any more
            if isinstance(item, StreamOutput) and item.finish_reason is None:
                self._abort(stream)


async def collect(outputs: AsyncIterator[StreamOutput]) -> Result:
    """A request's outputs to the end, as one Result."""
    text, tokens, last = [], [], None
    async for last in outputs:
        text.append(last.text)
        tokens += last.token_ids
    return Result("".join(text), tokens, last.prompt_tokens, last.finish_reason, last.stats)

