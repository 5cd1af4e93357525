"""The OpenAI wire format: request bodies (pydantic, strict types, unknown fields ignored as OpenAI
does) and the response, chunk and error objects (plain dicts)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..request import Stats

FINISH = {"stop_string": "stop"}  # our finish reasons -> OpenAI's: "stop" | "length" (the rest as they are)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: object) -> object:
        if isinstance(content, list) and not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
        return content

    def to_template(self) -> dict[str, str]:
        """What the chat template sees: a known role and text only."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class StreamOptions(_Body):
    include_usage: bool | None = None


class SamplingBody(_Body):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)  # None: 1, OpenAI's default
    seed: int | None = Field(None, ge=0)  # None: a random seed
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None  # only 1
    return_token_ids: bool | None = None  # extension (as vLLM's): the generated ids in `dspark.token_ids`

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatRequest(SamplingBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingBody):
    prompt: str


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, stats: Stats | None) -> dict:
    cached = getattr(stats, "cached_tokens", 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def dspark_stats(stats: Stats, prompt_tokens: int, completion_tokens: int) -> dict:
    """The extension field `dspark` of a response (or of a stream's last chunk)."""
    d = stats.to_dict(completion_tokens)
    cached = getattr(stats, "cached_tokens", 0)
    return {"tau": d["tau"], "mean_verified": d["mean_verified"], "cycles": d["cycles"],
            "drafted_cycles": d["drafted_cycles"], "mean_batch": d["mean_batch"],
            "per_position_acceptance": d["per_position_acceptance"],
            "prefill_s": stats.times.get("prefill", 0.0), "total_s": stats.times.get("total", 0.0),
            "cached_tokens": cached, "prefilled_tokens": prompt_tokens - cached}


class Api:
    """The objects of one endpoint: chat completions, or (chat=False) text completions."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.id_prefix = "chatcmpl-" if chat else "cmpl-"

    def choice(self, text: str, finish_reason: str | None, stream: bool, first: bool = False) -> dict:
        if not self.chat:
            body = {"text": text}
        elif not stream:
            body = {"message": {"role": "assistant", "content": text}}
        else:
            body = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}

    def body(self, id_: str, created: int, model: str, choices: list[dict], extra: dict, chunk: bool) -> dict:
        obj = self.chunk_object if chunk else self.object
        return {"id": id_, "object": obj, "created": created, "model": model, "choices": choices, **extra}
