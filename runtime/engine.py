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
from .errors import InputError
from .generate import SamplingParams, Stats, generate
from .manifest import Manifest
from .ort_backend import OrtBackend
from .scheduler import FixedLength, Scheduler, StaticThreshold
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


def make_scheduler(name: str, threshold: float = 0.5) -> Scheduler | None:
    if name == "none":
        return None
    if name == "fixed":
        return FixedLength()
    if name == "threshold":
        return StaticThreshold(threshold)
    raise InputError(f"unknown scheduler {name!r}; choose none, fixed or threshold")


class Engine:
    def __init__(self, bundle: Path, manifest: Manifest, backend: Backend, tokenizer: ChatTokenizer):
        self.bundle, self.manifest, self.backend, self.tokenizer = bundle, manifest, backend, tokenizer

    @classmethod
    def load(cls, bundle: str | Path, max_seq: int | None = None, backend: str = "onnxruntime",
             provider: str = "cpu", threads: int | None = None, target_graph: str = "auto") -> "Engine":
        """Validate the bundle's manifest, open its graphs (onnxruntime) or engines (tensorrt, built
        by `dspark build`) and preallocate KV for `max_seq` positions (default: 2048 or the model's
        limit, whichever is smaller; for tensorrt, what the engines were built for)."""
        bundle = Path(bundle)
        manifest = Manifest.load(bundle)
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

            return cls(bundle, manifest, tensorrt_backend(bundle, manifest, max_seq), tokenizer)
        max_seq = min(2048, limit) if max_seq is None else max_seq
        backend_ = OrtBackend(bundle, manifest, max_seq, provider, threads, target_graph=target_graph)
        return cls(bundle, manifest, backend_, tokenizer)

    def encode(self, prompt: str | Sequence[dict[str, str]], chat: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            return self.tokenizer.encode_chat(list(prompt))
        return self.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else self.tokenizer.encode(prompt)

    def generate(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int = 256,
                 temperature: float = 0.0, seed: int = 0, chat: bool = True, scheduler: str = "fixed",
                 threshold: float = 0.5, stop: Sequence[str] = (),
                 on_text: Callable[[str], None] | None = None) -> Result:
        """One request. `prompt` is a user message (wrapped in the chat template unless
        chat=False) or a list of chat messages. `on_text` streams the decoded text."""
        params = SamplingParams(temperature, max_new_tokens, seed, self.manifest.stop_token_ids)
        sched = make_scheduler(scheduler, threshold)
        ids = self.encode(prompt, chat)
        stream, text = self.tokenizer.stream(), []

        def on_tokens(tokens: list[int]) -> bool:
            for t in tokens:
                piece = stream.step(self.tokenizer.tokenizer, t)
                if piece:
                    text.append(piece)
                    if on_text is not None:
                        on_text(piece)
            return bool(stop) and any(s in "".join(text) for s in stop)

        gen = generate(self.backend, ids, params, sched, on_tokens)
        out = self.tokenizer.decode(gen.token_ids)
        for s in stop:
            if s in out:
                out = out[:out.index(s)]
        return Result(out, gen.token_ids, len(ids), gen.finish_reason, gen.stats)
