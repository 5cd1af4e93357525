"""The speculative decoding loop: prefill → draft → schedule → verify → accept → commit.

One loop for every backend (dspark.md §1), serving up to `backend.slots` requests at
once: one drafter pass for all of them, then one target pass in which each verifies its
own ℓ_r drafts (rows right-padded to 1 + max ℓ). Requests join free slots and leave
between steps. A request's output does not depend on who else is in the batch: it has
its own RNG stream (seeded by its SamplingParams), and the scheduler's choice of ℓ_r
never changes the output distribution (greedy: the tokens). The target alone when
`scheduler` is None.

While a scheduler skips the drafter (`should_draft`), the context the drafter misses piles up;
the next drafting round feeds it at most `catch_up` rows per request and the drafter's context
restarts there (older positions are masked), so a probe after a long skip, or the first round
of a request that joined meanwhile (its prompt is then not fed at join), costs about one
drafter pass. Only the proposals change, never the output."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .backend import Backend, Draft
from .errors import InputError
from .sampling import check_temperature, sample_token, verify
from .scheduler import History, Scheduler

CATCH_UP = 32  # context rows per request that a drafting round after skipped steps feeds at most


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    max_new_tokens: int = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens is {self.max_new_tokens}, expected >= 1")


@dataclass
class Stats:
    cycles: int = 0
    drafted: int = 0  # cycles in which the drafter ran
    emitted: list[int] = field(default_factory=list)  # τ per cycle (accepted + emitted token)
    verified: list[int] = field(default_factory=list)  # ℓ per cycle
    attempts: np.ndarray | None = None  # [γ] cycles in which slot k was verified with 1..k-1 accepted
    accepts: np.ndarray | None = None  # [γ] of those, cycles in which slot k was accepted
    batch: list[int] = field(default_factory=list)  # requests in the batch, per cycle
    confidences: list[np.ndarray] = field(default_factory=list)  # raw confidence logits [γ] per drafted cycle
    # seconds in the engine calls; verify includes the acceptance rule only where a backend runs it on its device
    times: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0,
                                                             "decode": 0.0, "total": 0.0})

    @property
    def tau(self) -> float:
        return float(np.mean(self.emitted)) if self.emitted else 0.0

    @property
    def per_position_acceptance(self) -> list[float | None]:
        if self.attempts is None:
            return []
        return [float(a / n) if n else None for a, n in zip(self.accepts, self.attempts)]

    def to_dict(self, new_tokens: int) -> dict:
        decode_time = self.times["total"] - self.times["prefill"]
        return {
            "tau": self.tau,
            "cycles": self.cycles,
            "drafted_cycles": self.drafted,
            "mean_verified": float(np.mean(self.verified)) if self.verified else 0.0,
            "mean_batch": float(np.mean(self.batch)) if self.batch else 0.0,
            "per_position_acceptance": self.per_position_acceptance,
            "tokens_per_s": new_tokens / self.times["total"] if self.times["total"] > 0 else 0.0,
            "decode_tokens_per_s": (new_tokens - 1) / decode_time if decode_time > 0 else 0.0,
            "times_s": dict(self.times),
        }


@dataclass
class Generation:
    token_ids: list[int]
    stats: Stats
    finish_reason: str  # "stop" (a stop token) | "stop_string" | "length"


@dataclass
class Request:
    prompt_ids: Sequence[int]
    params: SamplingParams
    on_tokens: Callable[[list[int]], bool] | None = None  # each committed chunk; True ends the request


@dataclass
class _Active:
    """The decoding state of one request in its slot."""

    index: int  # position in the request list
    request: Request
    rng: np.random.Generator
    stats: Stats
    t_join: float
    anchor: int = 0  # the last emitted token, at position `start`
    start: int = 0
    # target features not yet fed to the drafter, [rows, F] chunks: start - ctx_start rows in all
    # (a list, so that steps without drafting append in O(1))
    ctx: list[np.ndarray] = field(default_factory=list)
    floor: int = 0  # the drafter reads its context from this position on
    out: list[int] = field(default_factory=list)
    done: str = ""  # the finish reason once finished

    def window(self, rows: int) -> None:
        """Keep at most the newest `rows` features not yet fed to the drafter; the drafter's
        context then restarts at the oldest kept one."""
        if sum(map(len, self.ctx)) > rows:
            self.ctx = [np.concatenate(self.ctx)[-rows:]]
            self.floor = self.start - rows

    def commit(self, tokens: list[int]) -> None:
        """Append tokens up to the first stop token or the budget; set `done` when the request ends."""
        p = self.request.params
        keep = []
        for t in tokens:
            keep.append(t)
            if t in p.stop_token_ids or len(self.out) + len(keep) >= p.max_new_tokens:
                self.done = "stop" if t in p.stop_token_ids else "length"
                break
        self.out.extend(keep)
        if self.request.on_tokens is not None and keep and self.request.on_tokens(keep):
            self.done = "stop_string"


def generate(backend: Backend, prompt_ids: Sequence[int], params: SamplingParams,
             scheduler: Scheduler | None, on_tokens: Callable[[list[int]], bool] | None = None) -> Generation:
    """Decode up to `params.max_new_tokens` tokens after `prompt_ids` (one request).

    `on_tokens` receives each committed chunk; returning True ends decoding (stop strings)."""
    return generate_batch(backend, [Request(prompt_ids, params, on_tokens)], scheduler)[0]


def check_requests(backend: Backend, requests: Sequence[Request]) -> None:
    """Every request must fit a slot: prompt + budget + one block."""
    gamma = backend.block_size
    for r in requests:
        n, p = len(r.prompt_ids), r.params
        if n == 0:
            raise InputError("the prompt is empty")
        need = n + p.max_new_tokens + gamma + 1
        if need > backend.max_seq:
            raise InputError(f"prompt of {n} tokens + max_new_tokens {p.max_new_tokens} + block {gamma + 1} "
                             f"= {need} exceeds the context of {backend.max_seq} positions")


def generate_batch(backend: Backend, requests: Sequence[Request], scheduler: Scheduler | None,
                   catch_up: int = CATCH_UP) -> list[Generation]:
    """Serve `requests`, at most `backend.slots` at a time, in order of arrival; results in the same order.
    `catch_up` (> γ, so that a request drafted every step keeps its whole context): see the module doc."""
    check_requests(backend, requests)
    if catch_up <= backend.block_size:
        raise InputError(f"catch_up is {catch_up}, expected more than the block size {backend.block_size}")
    queue = deque(range(len(requests)))
    slots: list[_Active | None] = [None] * backend.slots
    results: list[Generation | None] = [None] * len(requests)
    history = History(deque(maxlen=2))
    speculative = scheduler is not None

    while queue or any(slots):
        for s in range(backend.slots):  # join: prefill new requests into free slots
            if slots[s] is None and queue:  # while the drafter is skipped, its prompt waits for the next round
                ingest = speculative and not history.undrafted
                slots[s] = _prefill(backend, s, queue.popleft(), requests, speculative, ingest)
        rows = [s for s, a in enumerate(slots) if a is not None and not a.done]
        if rows:
            drafting = speculative and scheduler.should_draft(history, len(rows))
            _step(backend, slots, rows, scheduler if drafting else None, history, speculative, catch_up)
        for s, a in enumerate(slots):  # leave: finished requests free their slot
            if a is not None and a.done:
                a.stats.times["total"] = time.perf_counter() - a.t_join
                results[a.index] = Generation(a.out, a.stats, a.done)
                slots[s] = None
    return results


def _prefill(backend: Backend, slot: int, index: int, requests: Sequence[Request], speculative: bool,
             ingest: bool) -> _Active:
    """A request joins `slot`. Without `ingest` the drafter is not fed its prompt now: the prompt
    rows wait for the next drafting round (which windows them to `catch_up`)."""
    req = requests[index]
    gamma = backend.block_size
    t0 = time.perf_counter()
    a = _Active(index, req, np.random.default_rng(req.params.seed),
                Stats(attempts=np.zeros(gamma, np.int64), accepts=np.zeros(gamma, np.int64)), t0)
    logits, feats = backend.prefill(slot, np.asarray(req.prompt_ids, dtype=np.int64), ingest)  # [V], [1 or n, F]
    a.anchor = sample_token(logits, req.params.temperature, a.rng.random())
    a.start = len(req.prompt_ids)
    a.ctx = [feats] if speculative else []  # ingested: the drafter has positions 0..n-2; row n-1 comes next
    a.stats.times["prefill"] = time.perf_counter() - t0
    a.commit([a.anchor])
    return a


def _step(backend: Backend, slots: list[_Active | None], rows: list[int], scheduler: Scheduler | None,
          history: History, speculative: bool, catch_up: int) -> None:
    """One cycle for the requests in `rows` (slot indices): drafted and verified when a scheduler
    is given, else one target token each (features kept for the drafter when `speculative`)."""
    B, R, gamma = rows[-1] + 1, len(rows), backend.block_size
    act = [slots[s] for s in rows]
    starts = np.zeros(B, np.int64)  # [B] free slots below the last busy one are dummy rows at position 0
    starts[rows] = [a.start for a in act]
    if scheduler is None:
        tokens = np.zeros((B, 1), np.int64)  # [B, 1]
        tokens[rows, 0] = [a.anchor for a in act]
        t0 = time.perf_counter()
        logits, feats = backend.target(tokens, starts)  # [B, 1, V], [B, 1, F]
        t1 = time.perf_counter()
        for s, a in zip(rows, act):
            a.anchor = sample_token(logits[s, 0], a.request.params.temperature, a.rng.random())
            a.start += 1
            if speculative:
                a.ctx.append(feats[s])
                if len(a.ctx) > 2 * catch_up:  # bounded memory while the drafter is skipped
                    a.window(catch_up)
            _record(a, 0, 0, R, decode=t1 - t0)
            a.commit([a.anchor])
        history.undrafted += 1
        return

    for a in act:
        a.window(catch_up)
    u = np.zeros((B, 2 * gamma + 1))  # [B, 2γ+1] draft draws, acceptance draws, the emitted token's draw
    u[rows] = [a.rng.random(2 * gamma + 1) for a in act]
    counts = np.zeros(B, np.int64)  # [B] new context rows per slot
    counts[rows] = [sum(map(len, a.ctx)) for a in act]
    features = np.zeros((B, counts.max(), act[0].ctx[0].shape[1]), np.float32)  # [B, n, F] right-padded
    for s, a in zip(rows, act):
        features[s, :counts[s]] = np.concatenate(a.ctx)
    floors = np.zeros(B, np.int64)  # [B]
    floors[rows] = [a.floor for a in act]
    anchors = np.zeros(B, np.int64)
    anchors[rows] = [a.anchor for a in act]
    temps = np.zeros(B)  # [B] float64, as the host acceptance rule gets them
    temps[rows] = [a.request.params.temperature for a in act]
    t0 = time.perf_counter()  # the phases time the engine calls; the rest of the cycle is the loop's
    draft = backend.draft(features, counts, starts - counts, anchors, temps, u[:, :gamma], floors=floors)
    t1 = time.perf_counter()

    conf = draft.confidence_logits[rows]  # [R, γ]
    caps = np.array([a.request.params.max_new_tokens - len(a.out) - 1 for a in act])  # budget left after the anchor
    ells = np.minimum(scheduler.lengths(conf, history), caps)  # [R]
    history.confidences.append(conf)
    history.undrafted = 0
    S = 1 + int(ells.max())
    tokens = np.zeros((B, S), np.int64)  # [B, S] anchor, ℓ_r drafts, then padding
    tokens[rows, 0] = anchors[rows]
    tokens[rows, 1:] = draft.tokens[rows, :S - 1]  # drafts past ℓ_r are padding: never accepted, never committed
    lengths = np.zeros(B, np.int64)  # [B] ℓ_r; dummy rows verify nothing
    lengths[rows] = ells
    t2 = time.perf_counter()
    if getattr(backend, "accepts_on_device", False):  # the same rule, applied where the logits are
        accepted, emitted, feats = backend.verify_on_device(tokens, starts, lengths, temps, u[:, gamma:])
        t3 = time.perf_counter()
    else:
        logits, feats = backend.target(tokens, starts)  # [B, S, V], [B, S, F]
        t3 = time.perf_counter()
        accepted, emitted = _accept(draft, logits, rows, lengths, temps, u[:, gamma:])
    for i, (s, a) in enumerate(zip(rows, act)):
        ell, acc, token = int(lengths[s]), int(accepted[s]), int(emitted[s])
        a.stats.attempts[:min(acc + 1, ell)] += 1
        a.stats.accepts[:acc] += 1
        a.stats.drafted += 1
        a.stats.confidences.append(conf[i])
        _record(a, ell, acc, R, draft=t1 - t0, verify=t3 - t2)
        a.commit([int(t) for t in draft.tokens[s, :acc]] + [token])
        a.ctx, a.start, a.anchor = [feats[s, :acc + 1]], a.start + acc + 1, token


def _accept(draft: Draft, logits: np.ndarray, rows: list[int], lengths: np.ndarray, temps: np.ndarray,
            u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The acceptance rule on the host for the busy rows: logits [B, S, V], u [B, γ+1] (acceptance
    draws, then the emitted token's draw) -> accepted drafts [B] and the emitted token [B]."""
    gamma = u.shape[1] - 1
    accepted, emitted = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    for s in rows:
        ell = lengths[s]
        p_d = None if temps[s] == 0 else draft.probs[s, :ell]  # greedy rows: tokens are compared
        accepted[s], emitted[s] = verify(draft.tokens[s, :ell], p_d, logits[s, :ell + 1],
                                         float(temps[s]), u[s, :gamma], u[s, gamma])
    return accepted, emitted


def _record(a: _Active, ell: int, accepted: int, batch: int, **times: float) -> None:
    a.stats.cycles += 1
    a.stats.verified.append(ell)
    a.stats.emitted.append(accepted + 1)
    a.stats.batch.append(batch)
    for k, v in times.items():
        a.stats.times[k] += v
