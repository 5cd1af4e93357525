"""The runtime's public API: load a bundle once, serve many requests.

    from dspark.runtime import Engine
    engine = Engine.load("engines/smollm2")
    result = engine.generate("What is 17 * 23?", max_new_tokens=128)
    print(result.text, result.stats.tau)

`generate` and `generate_batch` drive the step-wise `EngineCore` (core.py) to completion; a
service drives one itself (`engine.core()`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .backends import Backend, BackendOptions, open_backend
from .calibration import Calibration
from .core import MIN_PREFIX, PREFILL_CHUNK, EngineCore, check_prompt
from .errors import InputError
from .manifest import Manifest
from .request import SamplingParams, Stats
from .schedulers import Scheduler, make_scheduler
from .throughput import SpsTable
from .tokenizer import ChatTokenizer

Prompt = str | Sequence[dict[str, str]]  # a user message, or chat messages


@dataclass
class Result:
    text: str
    token_ids: list[int]  # the generated ids only
    prompt_tokens: int
    finish_reason: str  # "stop" (a stop token) | "stop_string" | "length"
    stats: Stats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict(len(self.token_ids))}


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to the first stop string in it."""
    return text[:min((text.index(s) for s in stop if s in text), default=len(text))]


class TextStream:
    """A request's text as its tokens come (incremental detokenization), and whether a stop string
    has appeared in it."""

    def __init__(self, tokenizer: ChatTokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.decoder = tokenizer.stream()
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """The new text of `token_ids`, and whether the text so far holds a stop string."""
        piece = "".join(self.decoder.step(self.tokenizer.tokenizer, t) or "" for t in token_ids)
        self.text += piece
        return piece, any(s in self.text for s in self.stop)


class Engine:
    def __init__(self, bundle: Path, manifest: Manifest, backend: Backend, tokenizer: ChatTokenizer,
                 sps: SpsTable | None = None, calibration: Calibration | None = None,
                 prefill_chunk: int | None = PREFILL_CHUNK, min_prefix: int | None = MIN_PREFIX):
        self.bundle, self.manifest, self.backend, self.tokenizer = bundle, manifest, backend, tokenizer
        self.sps, self.calibration = sps, calibration
        self.prefill_chunk, self.min_prefix = prefill_chunk, min_prefix  # what its cores get (core.py)

    @classmethod
    def load(cls, bundle: str | Path, max_seq: int | None = None, backend: str = "onnxruntime",
             provider: str = "cpu", threads: int | None = None, target_graph: str = "auto",
             drafter_graph: str = "auto", slots: int = 1, read_tables: bool = True,
             prefill_chunk: int | None = PREFILL_CHUNK, min_prefix: int | None = MIN_PREFIX) -> "Engine":
        """Validate the bundle's manifest (and, with `read_tables`, its SPS table and calibration
        when present), open its graphs or engines through the backend registry (backends/) and
        preallocate KV for `slots` concurrent requests of `max_seq` positions (default: 2048 or the
        model's limit, whichever is smaller; for tensorrt, what the engines were built for).
        prefill_chunk (prompt tokens prefilled per step; None: whole prompts) and min_prefix (the
        shortest prefix a request reuses from a free slot's KV; None: no reuse) go to every core
        (core.py's module doc)."""
        bundle = Path(bundle)
        manifest = Manifest.load(bundle)
        sps, calibration = None, None
        if read_tables:  # `dspark profile` and `dspark calibrate` rewrite them, corrupt or not
            sps, calibration = SpsTable.load(bundle, manifest.precision), Calibration.load(bundle, manifest)
        tokenizer = ChatTokenizer(bundle / manifest.tokenizer, manifest.chat_template, manifest.special_tokens)
        if tokenizer.vocab_size > manifest.target.vocab_size:
            raise InputError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                             f"{manifest.target.vocab_size}")
        options = BackendOptions(max_seq, slots, provider, threads, target_graph, drafter_graph)
        backend_ = open_backend(backend, bundle, manifest, options)
        if sps is not None:  # the drafter cost of the graph this engine runs
            sps = sps.for_drafter(backend_.drafter_graph)
        return cls(bundle, manifest, backend_, tokenizer, sps, calibration, prefill_chunk, min_prefix)

    def scheduler(self, name: str = "auto", threshold: float = 0.5) -> Scheduler | None:
        return make_scheduler(name, threshold, self.sps, self.calibration, str(self.bundle))

    def core(self, scheduler: str = "auto", threshold: float = 0.5, max_waiting: int | None = None,
             **options: int | None) -> EngineCore:
        """A step-wise core over this engine's backend (one at a time: they share its KV slots, and a
        core reuses only the prefixes its own requests left). `options`: prefill_chunk, min_prefix
        (default: the engine's)."""
        options = {"prefill_chunk": self.prefill_chunk, "min_prefix": self.min_prefix, **options}
        return EngineCore(self.backend, self.scheduler(scheduler, threshold), max_waiting=max_waiting, **options)

    def params(self, temperature: float = 0.0, max_new_tokens: int = 256, seed: int = 0,
               stop: Sequence[str] = ()) -> SamplingParams:
        """SamplingParams with the bundle's stop tokens."""
        return SamplingParams(temperature, max_new_tokens, seed, tuple(stop), self.manifest.stop_token_ids)

    def encode(self, prompt: Prompt, chat: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            return self.tokenizer.encode_chat(list(prompt))
        return self.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else self.tokenizer.encode(prompt)

    def generate(self, prompt: Prompt, *, max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
                 chat: bool = True, scheduler: str = "auto", threshold: float = 0.5, stop: Sequence[str] = (),
                 on_text: Callable[[str], None] | None = None) -> Result:
        """One request. `prompt` is a user message (wrapped in the chat template unless
        chat=False) or a list of chat messages. `on_text` streams the decoded text."""
        return self.generate_batch([prompt], max_new_tokens=max_new_tokens, temperature=temperature, seeds=[seed],
                                   chat=chat, scheduler=scheduler, threshold=threshold, stop=stop,
                                   on_text=None if on_text is None else (lambda i, s: on_text(s)))[0]

    def generate_batch(self, prompts: Sequence[Prompt], *, max_new_tokens: int = 256, temperature: float = 0.0,
                       seeds: Sequence[int] | None = None, chat: bool = True, scheduler: str = "auto",
                       threshold: float = 0.5, stop: Sequence[str] = (),
                       on_text: Callable[[int, str], None] | None = None) -> list[Result]:
        """Several requests, served `slots` at a time (Engine.load) in order; request i samples with
        seed seeds[i] (default i). `on_text(i, piece)` streams request i's text."""
        seeds = list(range(len(prompts))) if seeds is None else list(seeds)
        if len(seeds) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        params = [self.params(temperature, max_new_tokens, seed, stop) for seed in seeds]
        ids = [self.encode(p, chat) for p in prompts]
        for x, p in zip(ids, params):  # every request is checked before any is served (or a scheduler warns)
            check_prompt(self.backend, x, p)
        core = self.core(scheduler, threshold)
        streams = [TextStream(self.tokenizer, stop) for _ in prompts]
        finished: dict[int, tuple[list[int], str, Stats]] = {}
        for i, (x, p) in enumerate(zip(ids, params)):
            core.add_request(i, x, p)
        while core.has_unfinished():
            for out in core.step():
                piece, stopped = streams[out.request_id].add(out.new_token_ids)
                if piece and on_text is not None:
                    on_text(out.request_id, piece)
                if stopped and not out.finished:  # a stop string: end it now, its slot frees for the next step
                    core.abort_request(out.request_id)
                if stopped or out.finished:
                    finished[out.request_id] = (out.token_ids, "stop_string" if stopped else out.finish_reason,
                                                out.stats)
        return [Result(cut_at_stop(self.tokenizer.decode(tokens), stop), tokens, len(x), reason, stats)
                for x, (tokens, reason, stats) in zip(ids, (finished[i] for i in range(len(ids))))]
