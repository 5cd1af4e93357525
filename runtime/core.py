"""The decoding loop, one step at a time (dspark.md §1): prefill → draft → schedule → verify →
accept → commit.

`EngineCore` has the shape of vLLM's LLMEngine: `add_request` queues a request, `abort_request`
ends one, `step` runs one cycle and returns what each request committed. It serves up to
`backend.slots` requests at once: a step first prefills waiting requests into free slots, then
runs one drafter pass for every busy slot and one target pass in which each verifies its own
ℓ_r drafts (rows right-padded to 1 + max ℓ). Requests join and leave between steps.

A request's output does not depend on who else is in the batch: it has its own random stream
(seeded by its SamplingParams), its rows are computed apart from the others' (up to
floating-point rounding, which differs between batch shapes), and a scheduler's choice of ℓ_r
never changes the output distribution (greedy: the tokens). Without a scheduler, the target alone.

While a scheduler skips the drafter (`should_draft`), the context the drafter misses piles up;
the next drafting round feeds it at most `catch_up` rows per request and the drafter's context
restarts there (older positions are masked), so a probe after a long skip, or the first round
of a request that joined meanwhile (its prompt is then not fed at join), costs about one
drafter pass. Only the proposals change, never the output.

**Chunked prefill** (`prefill_chunk` P): a joining request's prompt is prefilled at most P tokens a
step, and a step prefills at most P prompt tokens in all, so a long prompt that joins does not stall
the running requests, which take their cycle in the same step. A request's chunks are
[start, start+P), [start+P, start+2P), ... whoever else joins (the oldest joining request's next
chunk always runs; a later one's runs if it fits what is left), so how its prompt is cut never
depends on the batch. Until its last chunk, which samples its first token (the anchor), a request
holds its slot without a cycle ("prefilling"). The drafter is fed each chunk's rows as it is
prefilled: a context row's K/V depend only on its features and position, so its context cache ends
up as after one call (up to rounding; with the int8 drafter, up to its per-call activation scale,
which changes proposals only). Leaving the rows in `ctx` instead would window them to `catch_up` at
the first round: another context, other proposals.

**Prefix reuse** (`min_prefix`; per slot, like vLLM's automatic prefix caching or llama-server's
cache_prompt): a slot keeps what its last request committed to the KV (prompt + generated tokens
[0, start); an aborted request keeps what it had committed). A joining request takes the free slot
that shares the longest prefix with its prompt, of at least `min_prefix` tokens (else the lowest
free slot), and its prefill starts there; the last prompt token always runs, for the anchor's
logits. The drafter's context KV is reused where it is valid, [floor, first row not yet fed) of the
slot's last request: the prefill starts at the end of that range when it ends before the shared
prefix (recomputing those few target rows to feed the drafter their features), and the request's
drafter context starts at its floor, as after a catch-up. Only when that floor is 0 is the drafter's
context the one a fresh prefill gives; otherwise only the proposals change. `Stats.cached_tokens`
counts the prompt tokens reused.

Both need a backend whose `prefill` starts at a position (`supports_prefix`); with any other, prompts
are prefilled whole, from position 0. Kept prefixes belong to the core: one forgets them when another
core has stepped over its backend since its own last step (cores over one backend take turns)."""
from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .backends.base import Backend, Draft, StepBatch
from .errors import DSparkError, InputError
from .request import SamplingParams, Stats
from .sampling import sample
from .schedulers.base import History, Scheduler

CATCH_UP = 32  # context rows per request that a drafting round after skipped steps feeds at most
# Prompt tokens prefilled per step. Each chunk lengthens the running requests' step by one call of
# at most P rows, while a prompt of up to P tokens (most chat turns) still prefills in one call, as
# unchunked: 256 bounds the stall by a long prompt to that of a typical one, for batch work, where
# no stream waits and fewer, larger calls prefill faster.
PREFILL_CHUNK = 256
# The same for a server's streams (AsyncEngine, `dspark serve`): the step that carries a chunk is
# their worst inter-token gap, and chunks of 64 lowered its p99 about 2x against 256 in the serving
# benchmark's long-prompt runs (docs/results.md), at some cost to a long prompt's first token.
SERVE_PREFILL_CHUNK = 64
# The shortest kept prefix a joining request reuses. Shorter ones save a few prompt rows of one call,
# while the match can pull the request above the lowest free slot, where the slots below it ride
# along as dummy rows in every batched step; a chat template's fixed header alone is about that long.
MIN_PREFIX = 16
# id(backend) -> the core that stepped over it last: a core whose kept prefixes another core may have
# overwritten since its own last step forgets them (weak, so that finished cores and backends go)
_LAST_CORE: dict[int, weakref.ref] = {}


def room(backend: Backend, prompt_tokens: int) -> int:
    """The largest max_new_tokens a prompt of this many tokens may ask for: prompt + budget + one
    verification block within a slot's positions."""
    return backend.max_seq - prompt_tokens - backend.block_size - 1


def check_prompt(backend: Backend, prompt_ids: Sequence[int], params: SamplingParams) -> np.ndarray:
    """The prompt as int64 [n], if `backend` may serve it: non-empty, known ids, and prompt + budget +
    one block within a slot's positions."""
    ids = np.asarray(prompt_ids, np.int64).reshape(-1)
    n, V, gamma = len(ids), backend.vocab_size, backend.block_size
    if n == 0:
        raise InputError("the prompt is empty")
    if ids.min() < 0 or ids.max() >= V:
        raise InputError(f"the prompt holds token ids outside 0..{V - 1}")
    need = n + params.max_new_tokens + gamma + 1
    if params.max_new_tokens > room(backend, n):
        raise InputError(f"prompt of {n} tokens + max_new_tokens {params.max_new_tokens} + block {gamma + 1} "
                         f"= {need} exceeds the context of {backend.max_seq} positions")
    return ids


class EngineFullError(DSparkError):
    """The engine's waiting queue is full: retry later."""


class UnknownRequestError(DSparkError):
    """No request with that id is waiting or running."""


@dataclass
class RequestOutput:
    """What one step did for one request."""

    request_id: Hashable
    new_token_ids: list[int]  # committed in this step
    token_ids: list[int]  # every token generated so far (the request's own list: copy it to keep it)
    finish_reason: str | None  # None while running; "stop" (a stop token) | "length" | "abort"
    stats: Stats

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Request:
    """A request and its decoding state, waiting or in its slot."""

    request_id: Hashable
    prompt_ids: np.ndarray  # [n] int64
    params: SamplingParams
    rng: np.random.Generator
    stats: Stats
    t_start: float  # when it was added; reset when it joins a slot
    anchor: int = 0  # the last emitted token, at position `start`
    start: int = 0  # target KV committed for [0, start) (while prefilling: the prompt rows so far)
    # target features not yet fed to the drafter, [rows, F] chunks: start - ctx_start rows in all
    # (a list, so that steps without drafting append in O(1))
    ctx: list[np.ndarray] = field(default_factory=list)
    floor: int = 0  # the drafter reads its context from this position on
    out: list[int] = field(default_factory=list)  # empty while the prompt is prefilled
    new: list[int] = field(default_factory=list)  # committed in the current step
    finish_reason: str | None = None

    @property
    def prefilling(self) -> bool:
        """In its slot with prompt rows still to prefill (no token yet), or waiting."""
        return not self.out

    def window(self, rows: int) -> None:
        """Keep at most the newest `rows` features not yet fed to the drafter; the drafter's
        context then restarts at the oldest kept one."""
        if sum(map(len, self.ctx)) > rows:
            self.ctx = [np.concatenate(self.ctx)[-rows:]]
            self.floor = self.start - rows

    def commit(self, tokens: list[int]) -> None:
        """Append tokens up to the first stop token or the budget; set the finish reason when it ends."""
        p = self.params
        for t in tokens:
            self.out.append(t)
            self.new.append(t)
            if t in p.stop_token_ids:
                self.finish_reason = "stop"
            elif len(self.out) >= p.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                return

    def record(self, drafted: bool, ell: int, accepted: int, batch: int, **times: float) -> None:
        s = self.stats
        s.drafted.append(drafted)
        s.verified.append(ell)
        s.emitted.append(accepted + 1)
        s.batch.append(batch)
        for k, v in times.items():
            s.times[k] += v

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.new, self.out, self.finish_reason, self.stats)


@dataclass
class _Kept:
    """What a free slot's KV still holds from its last request, for a joining request to reuse."""

    tokens: np.ndarray  # [c] int64: the tokens at positions 0..c-1 of the target's KV
    drafter: tuple[int, int]  # [lo, hi): the positions the drafter's context KV holds (read by speculative cores)


class EngineCore:
    """The step-wise decoding loop over one backend. `scheduler` None: the target alone."""

    def __init__(self, backend: Backend, scheduler: Scheduler | None, catch_up: int = CATCH_UP,
                 max_waiting: int | None = None, prefill_chunk: int | None = PREFILL_CHUNK,
                 min_prefix: int | None = MIN_PREFIX):
        """catch_up (> γ, so that a request drafted every step keeps its whole context), prefill_chunk
        (prompt tokens prefilled per step; None: whole prompts) and min_prefix (the shortest kept prefix
        reused; None: no reuse): see the module doc. max_waiting: how many requests may wait for a slot
        beyond those that take a free slot at the next step (None: no limit)."""
        if catch_up <= backend.block_size:
            raise InputError(f"catch_up is {catch_up}, expected more than the block size {backend.block_size}")
        for name, value in (("prefill_chunk", prefill_chunk), ("min_prefix", min_prefix)):
            if value is not None and value < 1:
                raise InputError(f"{name} is {value}, expected >= 1 or None")
        self.backend, self.scheduler, self.catch_up, self.max_waiting = backend, scheduler, catch_up, max_waiting
        # a backend whose prefill cannot start at a position gets whole prompts, never reused prefixes
        self.resumable = bool(getattr(backend, "supports_prefix", False))
        self.prefill_chunk = prefill_chunk if self.resumable else None
        self.min_prefix = min_prefix if self.resumable else None
        self.waiting: deque[_Request] = deque()
        self.slots: list[_Request | None] = [None] * backend.slots
        self.kept: list[_Kept | None] = [None] * backend.slots  # free slots' reusable KV
        self.requests: dict[Hashable, _Request] = {}  # waiting or running, by id
        self.history = History(deque(maxlen=2))

    # -- requests --

    def add_request(self, request_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Queue a request; it joins a free slot at the next step. Raises (adding nothing) for a
        duplicate id, a full queue, or a prompt that is empty, holds unknown ids or does not fit
        a slot with its budget."""
        if request_id in self.requests:
            raise InputError(f"request {request_id!r} is already waiting or running")
        ids = check_prompt(self.backend, prompt_ids, params)
        free = self.slots.count(None)
        if self.max_waiting is not None and len(self.waiting) >= free + self.max_waiting:
            raise EngineFullError(f"{len(self.waiting) - free} requests are waiting for a slot (max_waiting "
                                  f"{self.max_waiting}); retry later")
        gamma = self.backend.block_size
        stats = Stats(attempts=np.zeros(gamma, np.int64), accepts=np.zeros(gamma, np.int64))
        req = _Request(request_id, ids, params, np.random.default_rng(params.seed), stats, time.perf_counter())
        self.waiting.append(req)
        self.requests[request_id] = req

    def abort_request(self, request_id: Hashable) -> RequestOutput:
        """End a waiting or running request now: its slot is free for the next step. Returns its last
        output (finish reason "abort"); raises UnknownRequestError for an id that is not there."""
        req = self.requests.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(f"no request {request_id!r} is waiting or running")
        if req in self.waiting:
            self.waiting.remove(req)
        for s, r in enumerate(self.slots):
            if r is req:  # the slot keeps what the request committed
                self.slots[s], self.kept[s] = None, self._kept(req)
        req.finish_reason = "abort"
        req.new = []
        self._finish(req)
        return req.output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.slots)

    # -- one step --

    def step(self) -> list[RequestOutput]:
        """Join waiting requests into free slots, prefill the joining ones' next chunks, run one cycle for
        every other request in a slot, free the slots of finished ones. Returns an output for every
        request that committed tokens."""
        for r in self.requests.values():
            r.new = []
        last = _LAST_CORE.get(id(self.backend))
        if last is None or last() is not self:  # another core may have run over these slots since
            self.kept = [None] * len(self.kept)
            _LAST_CORE[id(self.backend)] = weakref.ref(self)
        speculative = self.scheduler is not None
        ingest = speculative and not self.history.undrafted  # while the drafter is skipped, prompts wait for it
        self._admit()
        self._prefill_chunks(ingest)
        rows = [s for s, r in enumerate(self.slots) if r is not None and not r.prefilling and r.finish_reason is None]
        if rows:
            if speculative and self.scheduler.should_draft(self.history, len(rows)):
                self._speculate(rows)
            else:
                self._decode(rows, speculative)
        outputs = []
        for s, r in enumerate(self.slots):
            if r is None or not r.new:
                continue
            outputs.append(r.output())
            if r.finish_reason is not None:  # finished requests free their slot, which keeps their KV
                self.slots[s], self.kept[s] = None, self._kept(r)
                del self.requests[r.request_id]
                self._finish(r)
        return outputs

    @staticmethod
    def _finish(r: _Request) -> None:
        r.stats.times["total"] = time.perf_counter() - r.t_start

    def _admit(self) -> None:
        """Waiting requests take free slots in order of arrival, each the one whose kept prefix it
        reuses the most (ties and no reuse: the lowest)."""
        free = [s for s, r in enumerate(self.slots) if r is None]
        while free and self.waiting:
            r = self.waiting.popleft()
            reuse = {s: self._reuse(s, r.prompt_ids) for s in free}
            slot = max(free, key=lambda s: (reuse[s][0], -s))
            free.remove(slot)
            r.start, r.floor = reuse[slot]
            r.stats.cached_tokens = r.start
            r.t_start = time.perf_counter()
            self.slots[slot], self.kept[slot] = r, None

    def _reuse(self, slot: int, prompt: np.ndarray) -> tuple[int, int]:
        """Where a prompt's prefill in `slot` may start, and the floor of its drafter context then."""
        kept = self.kept[slot]
        if kept is None or self.min_prefix is None:
            return 0, 0
        k = min(len(kept.tokens), len(prompt) - 1)  # the last prompt token always runs: the anchor's logits
        differ = np.flatnonzero(kept.tokens[:k] != prompt[:k])
        shared = int(differ[0]) if len(differ) else k
        start = floor = shared  # a drafter context restarts there, unless:
        if self.scheduler is not None:
            lo, hi = kept.drafter  # the drafter's context KV holds [lo, hi)
            if lo < min(hi, shared):  # reuse it; the target rows [hi, shared) rerun to feed it their features
                start, floor = min(hi, shared), lo
        return (start, floor) if start >= self.min_prefix else (0, 0)

    def _kept(self, r: _Request) -> _Kept | None:
        """What `r` leaves in its slot: its committed KV rows [0, start), holding its prompt then its
        tokens (a stop token inside accepted drafts ends the tokens before start), and the drafter's."""
        if self.min_prefix is None:
            return None
        tokens = np.concatenate([r.prompt_ids, np.asarray(r.out, np.int64)])[:r.start]  # [c]
        fed = r.start - sum(map(len, r.ctx))  # the first row the drafter has not been fed
        return _Kept(tokens, (r.floor, min(fed, len(tokens))))

    def _ends(self, B: int) -> np.ndarray:
        """[B] where the KV rows each of slots 0..B-1 keeps end (a prompt being prefilled, a free slot's
        kept prefix): a dummy row starts there, so that what it writes lands above them."""
        return np.array([r.start if r is not None else len(k.tokens) if k is not None else 0
                         for r, k in zip(self.slots[:B], self.kept[:B])], np.int64)

    def _prefill_chunks(self, ingest: bool) -> None:
        """The joining requests' next chunks, oldest first, up to `prefill_chunk` prompt tokens in all;
        a chunk that does not fit what is left waits for a later step (the oldest's always fits)."""
        joining = {r: s for s, r in enumerate(self.slots) if r is not None and r.prefilling}
        budget = self.prefill_chunk or np.inf
        for r in self.requests.values():  # in order of arrival, which is the order of joining
            if r not in joining:
                continue
            m = min(len(r.prompt_ids) - r.start, self.prefill_chunk or len(r.prompt_ids))
            if m <= budget:
                self._prefill(joining[r], r, m, ingest)
                budget -= m

    def _prefill(self, slot: int, r: _Request, m: int, ingest: bool) -> None:
        """Prefill r's next m prompt tokens, positions start..start+m-1 of `slot`. The drafter is fed
        them too when `ingest` and none of r's rows before them wait for it (its context stays
        contiguous); otherwise they wait in r.ctx for the next drafting round, which windows them to
        `catch_up`. The prompt's last chunk samples the first token (the anchor)."""
        t0 = time.perf_counter()
        a, b, n = r.start, r.start + m, len(r.prompt_ids)
        feed = ingest and not r.ctx
        if self.resumable:
            logits, feats = self.backend.prefill(slot, r.prompt_ids[a:b], feed, start=a, last=b == n)  # [V], [k, F]
        else:  # the whole prompt in one call (m = n)
            logits, feats = self.backend.prefill(slot, r.prompt_ids, feed)
        r.start = b
        if self.scheduler is not None and len(feats):  # fed: at most the prompt's last row, which comes next
            r.ctx.append(feats)
        if b == n:
            r.anchor = int(sample(np, logits[None], [r.params.temperature], [r.rng.random()])[0])
            r.commit([r.anchor])
        r.stats.times["prefill"] += time.perf_counter() - t0

    def _decode(self, rows: list[int], speculative: bool) -> None:
        """One target token for each request in `rows` (features kept for the drafter when `speculative`)."""
        B, act = rows[-1] + 1, [self.slots[s] for s in rows]
        tokens = np.zeros((B, 1), np.int64)  # [B, 1]; other slots below the last busy one are dummy rows
        starts = self._ends(B)  # [B]
        temps, u = np.zeros(B), np.zeros(B)  # [B]
        for s, r in zip(rows, act):
            tokens[s, 0], starts[s], temps[s], u[s] = r.anchor, r.start, r.params.temperature, r.rng.random()
        t0 = time.perf_counter()
        logits, feats = self.backend.target(tokens, starts)  # [B, 1, V], [B, 1, F]
        t1 = time.perf_counter()
        emitted = sample(np, logits[:, 0], temps, u)  # [B]
        for s, r in zip(rows, act):
            r.anchor = int(emitted[s])
            r.start += 1
            if speculative:
                r.ctx.append(feats[s])
                if len(r.ctx) > 2 * self.catch_up:  # bounded memory while the drafter is skipped
                    r.window(self.catch_up)
            r.record(False, 0, 0, len(rows), decode=t1 - t0)
            r.commit([r.anchor])
        self.history.undrafted += 1

    def _speculate(self, rows: list[int]) -> None:
        """Draft, schedule, verify and accept for the requests in `rows` (slot indices)."""
        backend, gamma = self.backend, self.backend.block_size
        act = [self.slots[s] for s in rows]
        for r in act:
            r.window(self.catch_up)
        batch = self._gather(rows, act)
        t0 = time.perf_counter()  # the phases time the engine calls; the rest of the cycle is the loop's
        draft = backend.draft(batch)
        t1 = time.perf_counter()

        conf = draft.confidence_logits[rows]  # [R, γ]
        caps = np.array([r.params.max_new_tokens - len(r.out) - 1 for r in act])  # budget left after the anchor
        batch.lengths[rows] = np.minimum(self.scheduler.lengths(conf, self.history), caps)
        self.history.confidences.append(conf)
        self.history.undrafted = 0
        batch.tokens = _verify_tokens(batch, draft)
        t2 = time.perf_counter()
        verdict = backend.verify(batch, draft)
        t3 = time.perf_counter()
        for i, (s, r) in enumerate(zip(rows, act)):
            ell, acc, token = int(batch.lengths[s]), int(verdict.accepted[s]), int(verdict.emitted[s])
            r.stats.attempts[:min(acc + 1, ell)] += 1
            r.stats.accepts[:acc] += 1
            r.stats.confidences.append(conf[i])
            r.record(True, ell, acc, len(rows), draft=t1 - t0, verify=t3 - t2)
            r.commit([int(t) for t in draft.tokens[s, :acc]] + [token])
            r.ctx, r.start, r.anchor = [verdict.features[s, :acc + 1]], r.start + acc + 1, token

    def _gather(self, rows: list[int], act: list[_Request]) -> StepBatch:
        """The step's rows as slot-indexed arrays; other slots below the last busy one are dummy rows."""
        B, gamma = rows[-1] + 1, self.backend.block_size
        counts = np.zeros(B, np.int64)  # [B]
        counts[rows] = [sum(map(len, r.ctx)) for r in act]
        batch = StepBatch(
            features=np.zeros((B, counts.max(), act[0].ctx[0].shape[1]), np.float32),  # [B, n, F]
            counts=counts, floors=np.zeros(B, np.int64), starts=self._ends(B),
            anchors=np.zeros(B, np.int64), temperatures=np.zeros(B),
            uniforms=np.zeros((B, 2 * gamma + 1)), lengths=np.zeros(B, np.int64))
        for s, r in zip(rows, act):
            batch.features[s, :counts[s]] = np.concatenate(r.ctx)
            batch.floors[s], batch.starts[s], batch.anchors[s] = r.floor, r.start, r.anchor
            batch.temperatures[s] = r.params.temperature
            batch.uniforms[s] = r.rng.random(2 * gamma + 1)
        return batch


def _verify_tokens(batch: StepBatch, draft: Draft) -> np.ndarray:
    """[B, 1 + max ℓ]: each row's anchor, then its drafts; drafts past ℓ_r are padding (never accepted)."""
    S = 1 + int(batch.lengths.max())
    tokens = np.empty((len(batch.anchors), S), np.int64)
    tokens[:, 0] = batch.anchors
    tokens[:, 1:] = draft.tokens[:, :S - 1]
    return tokens


@dataclass
class Request:
    prompt_ids: Sequence[int]
    params: SamplingParams


@dataclass
class Generation:
    token_ids: list[int]
    stats: Stats
    finish_reason: str  # "stop" (a stop token) | "length"


def generate_batch(backend: Backend, requests: Sequence[Request], scheduler: Scheduler | None,
                   catch_up: int = CATCH_UP, prefill_chunk: int | None = PREFILL_CHUNK) -> list[Generation]:
    """Serve `requests` to the end, at most `backend.slots` at a time in order of arrival; results in
    the same order. Every request is checked before any is served."""
    for r in requests:
        check_prompt(backend, r.prompt_ids, r.params)
    core = EngineCore(backend, scheduler, catch_up, prefill_chunk=prefill_chunk)
    for i, r in enumerate(requests):
        core.add_request(i, r.prompt_ids, r.params)
    results: list[Generation | None] = [None] * len(requests)
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                results[out.request_id] = Generation(out.token_ids, out.stats, out.finish_reason)
    return results


def generate(backend: Backend, prompt_ids: Sequence[int], params: SamplingParams,
             scheduler: Scheduler | None) -> Generation:
    """Decode up to `params.max_new_tokens` tokens after `prompt_ids` (one request)."""
    return generate_batch(backend, [Request(prompt_ids, params)], scheduler)[0]
