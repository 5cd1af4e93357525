"""The runtime's public API: load a bundle once, serve many requests.

    from dspark.runtime import Engine
    engine = Engine.load("engines/smollm2")
    result = engine.generate("What is 17 * 23?", max_new_tokens=128)
    print(result.text, result.stats.tau)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .backend import Backend
from .calibration import Calibration
from .errors import InputError
from .generate import Request, SamplingParams, Stats, check_requests, generate_batch
from .manifest import Manifest
from .ort_backend import OrtBackend
from .scheduler import Scheduler
from .schedulers import make_scheduler
from .throughput import SpsTable, drafter_graph_of
from .tokenizer import ChatTokenizer

BACKENDS = ("onnxruntime", "tensorrt")


@dataclass
class Result:
    text: str
    token_ids: list[int]  # the generated ids only
    prompt_tokens: int
    finish_reason: str
    stats: Stats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict(len(self.token_ids))}


class Engine:
    def __init__(self, bundle: Path, manifest: Manifest, backend: Backend, tokenizer: ChatTokenizer,
                 sps: SpsTable | None = None, calibration: Calibration | None = None):
        self.bundle, self.manifest, self.backend, self.tokenizer = bundle, manifest, backend, tokenizer
        self.sps, self.calibration = sps, calibration

    @classmethod
    def load(cls, bundle: str | Path, max_seq: int | None = None, backend: str = "onnxruntime",
             provider: str = "cpu", threads: int | None = None, target_graph: str = "auto",
             drafter_graph: str = "auto", slots: int = 1, read_tables: bool = True) -> "Engine":
        """Validate the bundle's manifest (and, with `read_tables`, its SPS table and calibration
        when present), open its graphs (onnxruntime) or engines (tensorrt, built by `dspark build`)
        and preallocate KV for `slots` concurrent requests of `max_seq` positions (default: 2048 or
        the model's limit, whichever is smaller; for tensorrt, what the engines were built for)."""
        bundle = Path(bundle)
        manifest = Manifest.load(bundle)
        sps, calibration = None, None
        if read_tables:  # `dspark profile` and `dspark calibrate` rewrite them, corrupt or not
            sps, calibration = SpsTable.load(bundle), Calibration.load(bundle, manifest.drafter.block_size)
        if backend not in BACKENDS:
            raise InputError(f"unknown backend {backend!r}; this runtime has: {', '.join(BACKENDS)}")
        limit = manifest.target.max_position_embeddings
        if max_seq is not None and not 1 < max_seq <= limit:
            raise InputError(f"max_seq is {max_seq}, expected 2..{limit} (the target's max_position_embeddings)")
        tokenizer = ChatTokenizer(bundle / manifest.tokenizer, manifest.chat_template, manifest.special_tokens)
        if tokenizer.vocab_size > manifest.target.vocab_size:
            raise InputError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                             f"{manifest.target.vocab_size}")
        if backend == "tensorrt":  # KV as long as the engines were built for, unless max_seq says otherwise
            from .trt.backend import tensorrt_backend

            backend_ = tensorrt_backend(bundle, manifest, max_seq, slots=slots)
        else:
            max_seq = min(2048, limit) if max_seq is None else max_seq
            backend_ = OrtBackend(bundle, manifest, max_seq, provider, threads, target_graph=target_graph,
                                  drafter_graph=drafter_graph, slots=slots)
        if sps is not None:  # the drafter cost of the graph this engine runs
            sps = sps.for_drafter(drafter_graph_of(backend_))
        return cls(bundle, manifest, backend_, tokenizer, sps, calibration)

    def scheduler(self, name: str = "auto", threshold: float = 0.5) -> Scheduler | None:
        return make_scheduler(name, threshold, self.sps, self.calibration, str(self.bundle))

    def encode(self, prompt: str | Sequence[dict[str, str]], chat: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            return self.tokenizer.encode_chat(list(prompt))
        return self.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else self.tokenizer.encode(prompt)

    def generate(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int = 256,
                 temperature: float = 0.0, seed: int = 0, chat: bool = True, scheduler: str = "auto",
                 threshold: float = 0.5, stop: Sequence[str] = (),
                 on_text: Callable[[str], None] | None = None) -> Result:
        """One request. `prompt` is a user message (wrapped in the chat template unless
        chat=False) or a list of chat messages. `on_text` streams the decoded text."""
        return self.generate_batch([prompt], max_new_tokens=max_new_tokens, temperature=temperature, seeds=[seed],
                                   chat=chat, scheduler=scheduler, threshold=threshold, stop=stop,
                                   on_text=None if on_text is None else (lambda i, s: on_text(s)))[0]

    def generate_batch(self, prompts: Sequence[str | Sequence[dict[str, str]]], *, max_new_tokens: int = 256,
                       temperature: float = 0.0, seeds: Sequence[int] | None = None, chat: bool = True,
                       scheduler: str = "auto", threshold: float = 0.5, stop: Sequence[str] = (),
                       on_text: Callable[[int, str], None] | None = None) -> list[Result]:
        """Several requests, served `slots` at a time (Engine.load); request i samples with seed
        seeds[i] (default i) and its output does not depend on the others. `on_text(i, piece)`."""
        seeds = list(range(len(prompts))) if seeds is None else list(seeds)
        if len(seeds) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        ids = [self.encode(p, chat) for p in prompts]
        texts: list[list[str]] = [[] for _ in prompts]

        def on_tokens(i: int):
            stream = self.tokenizer.stream()

            def step(tokens: list[int]) -> bool:
                for t in tokens:
                    piece = stream.step(self.tokenizer.tokenizer, t)
                    if piece:
                        texts[i].append(piece)
                        if on_text is not None:
                            on_text(i, piece)
                return bool(stop) and any(s in "".join(texts[i]) for s in stop)
            return step

        requests = [Request(x, SamplingParams(temperature, max_new_tokens, seed, self.manifest.stop_token_ids),
                            on_tokens(i)) for i, (x, seed) in enumerate(zip(ids, seeds))]
        check_requests(self.backend, requests)  # bad requests fail before the scheduler's fallback warning
        results = []
        for x, gen in zip(ids, generate_batch(self.backend, requests, self.scheduler(scheduler, threshold))):
            out = self.tokenizer.decode(gen.token_ids)
            for s in stop:
                if s in out:
                    out = out[:out.index(s)]
            results.append(Result(out, gen.token_ids, len(x), gen.finish_reason, gen.stats))
        return results
