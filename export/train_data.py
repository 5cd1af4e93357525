"""Training data for a drafter (dspark.md §6): prompts, target-generated responses, and the
target's states over them (cached on disk, or computed on the fly).

Pipeline, each stage resumable and regenerable by `scripts/train_drafter.py`:

1. Prompts: `../shared/data/train` (GSM8K questions; alpaca seed instructions + their first
   input) and, for chat/code variety, prompts the target writes itself when asked for a new
   user question seeded by an alpaca task (`synthesize_prompts`, T = 1). Anything under a
   `bench` directory is refused: those are evaluation prompts.
2. Responses: the target answers every prompt through its chat template (transformers
   `generate`, batched, left padding; or the deployed engine of a bundle, `EngineResponder`),
   greedily (T = 0) and sampled (T = 1, no top-k/top-p; `samples` responses a prompt, each
   from its own seed), into JSON Lines shards {key, source, temperature, sample, prompt,
   prompt_ids, response_ids, finished}. A response already written (same key) is skipped.
3. Features: one forward of the target per sequence gives the raw features at the drafter's
   `target_layer_ids` [T, m·d] and the last hidden state **after the target's final norm**
   [T, d] (lm_head of it = the target's logits), from our torch `TargetModel` (`TorchStates`)
   or from the bundle graph that serves (`engine_states.EngineStates`), stored as fp16 in
   safetensors shards with an index (`FeatureCache`). `OnTheFlySource` computes the same thing
   at train time instead (no disk; one target forward per sequence per step).
"""
from __future__ import annotations

import hashlib
import json
import lzma
import random
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import torch

from dspark.runtime.errors import ConfigError
from dspark.runtime.tools.prompts import (DEFAULT_TRAIN_DIR, DEFAULT_TRAIN_FILES, PROJECT_ROOT, DataError,  # noqa: F401
                                    Prompt, load_train_prompts, prompt_of, read_jsonl, read_prompts, refuse_bench)

from .target import TargetModel
from .training import TrainSequence

FP16_MAX = 65504.0


# --- 1. Prompts (runtime/prompts.py) ---------------------------------------------------------------


def prompt_key(prompt: Prompt, temperature: float, sample: int = 0) -> str:
    """Stable id of (prompt, temperature, sample): what a resumed generation skips by. Sample 0
    is the first response at that temperature (its key names no sample, as before samples existed)."""
    at = f"{temperature:g}" if sample == 0 else f"{temperature:g}#{sample}"
    return hashlib.sha256(f"{prompt.source}\x00{at}\x00{prompt.text}".encode()).hexdigest()[:20]


# --- 2. Responses -----------------------------------------------------------------------------------


def response_seed(seed: int, key: str) -> int:
    """The random seed of the response with key `key` in a run seeded by `seed`."""
    return int(hashlib.sha256((str(seed) + key).encode()).hexdigest()[:8], 16)


def load_generator(path: str | Path | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(transformers model, tokenizer) for generation: a .gguf file or a Hugging Face directory
    (None = the default SmolLM2 GGUF). The tokenizer pads on the left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .target_loader import default_target_path

    source = Path(path) if path is not None else default_target_path()
    kw = {"gguf_file": source.name} if source.suffix == ".gguf" else {}
    root = source.parent if source.suffix == ".gguf" else source
    model = AutoModelForCausalLM.from_pretrained(root, dtype=dtype, **kw).to(device).eval()
    tok = AutoTokenizer.from_pretrained(root, **kw)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def chat_ids(tokenizer, user_text: str) -> list[int]:
    """The chat-template prompt of one user message, as the runtime encodes it."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


def generate_batch(model, tokenizer, prompts_ids: list[list[int]], temperature: float, max_new_tokens: int,
                   seed: int) -> list[tuple[list[int], bool]]:
    """Left-padded batch through `generate`: greedy at T = 0, pure sampling at T > 0 (no top-k,
    no top-p). Returns (response ids up to and including the first stop token, finished)."""
    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts_ids)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts_ids])  # [B, W]
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_ids])
    stops = stop_ids(model, tokenizer)
    kw = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=float(temperature),
                                                              top_k=0, top_p=1.0)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                             max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad,
                             repetition_penalty=1.0, min_p=None, **kw)
    results = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), None)
        results.append((row[:cut + 1], True) if cut is not None else (row, False))
    return results


class Responder(Protocol):
    """What answers the prompts: `encode` a user message through the chat template, and `answer`
    encoded prompts at one temperature, prompt i with seed seeds[i], each response up to and
    including its first stop token, with whether it stopped (False: cut at max_new_tokens)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def answer(self, prompts_ids: list[list[int]], temperature: float, seeds: list[int],
               max_new_tokens: int) -> list[tuple[list[int], bool]]: ...


@dataclass
class TransformersResponder:
    """transformers' `generate` on the float model, one left-padded batch (seeded by seeds[0])."""
    model: Any
    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        return chat_ids(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def answer(self, prompts_ids: list[list[int]], temperature: float, seeds: list[int],
               max_new_tokens: int) -> list[tuple[list[int], bool]]:
        return generate_batch(self.model, self.tokenizer, prompts_ids, temperature, max_new_tokens, seeds[0])


@dataclass
class EngineResponder:
    """The deployed target: a bundle's engine (for a quantized bundle, its int8-activation graph),
    serving the prompts as concurrent requests over its slots. A sampled request draws what it
    would draw alone, from its own seed, so a response does not depend on its batch."""
    engine: Any  # dspark.runtime.Engine
    scheduler: str = "auto"

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids)

    def answer(self, prompts_ids: list[list[int]], temperature: float, seeds: list[int],
               max_new_tokens: int) -> list[tuple[list[int], bool]]:
        from dspark.runtime import Request
        from dspark.runtime.core import generate_batch as serve

        requests = [Request(ids, self.engine.params(temperature, max_new_tokens, seed))
                    for ids, seed in zip(prompts_ids, seeds)]
        return [(g.token_ids, g.finish_reason == "stop")
                for g in serve(self.engine.backend, requests, self.engine.scheduler(self.scheduler))]


def response_shards(directory: str | Path) -> list[Path]:
    """The response shards of `directory` in shard order: `responses-NNNNN.jsonl` as written, or
    `responses-NNNNN.jsonl.xz` as committed (`xz -9` of a finished shard; the data is text)."""
    shards = [*Path(directory).glob("responses-*.jsonl"), *Path(directory).glob("responses-*.jsonl.xz")]
    return sorted(shards, key=lambda f: f.name.split(".")[0])


def read_responses(directory: str | Path) -> list[dict[str, Any]]:
    """All response records of `directory`'s shards, first occurrence of a key wins.
    A truncated last line (a run killed mid-write) is skipped with a warning."""
    out, seen = [], set()
    for shard in response_shards(directory):
        raw = lzma.decompress(shard.read_bytes()) if shard.suffix == ".xz" else shard.read_bytes()
        lines = raw.decode("utf-8").splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):
                    warnings.warn(f"{shard}:{n}: truncated last record skipped (interrupted write)")
                    continue
                raise DataError(f"{shard}:{n}: not JSON Lines") from None
            if rec["key"] not in seen:
                seen.add(rec["key"])
                out.append(rec)
    return out


@dataclass
class GenerationConfig:
    temperatures: tuple[float, ...] = (0.0, 1.0)  # every prompt is answered at each temperature
    max_new_tokens: int = 512
    batch: int = 8
    seed: int = 0
    shard_records: int = 2000
    part: tuple[int, int] = (0, 1)  # (i, n): answer only the keys of part i of n (`in_part`), in shards "-p{i}"
    samples: int = 1  # responses per prompt at each temperature > 0, each from its own seed (greedy: one)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ConfigError(f"samples is {self.samples}, expected >= 1 (responses per prompt at each temperature > 0)")


def in_part(key: str, part: tuple[int, int]) -> bool:
    """Whether a response key belongs to part i of n: by a hash of the key, so that n processes
    started at different times over one data directory split the work the same way."""
    i, n = part
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % n == i


def generate_responses(responder: Responder, prompts: list[Prompt], out_dir: str | Path,
                       cfg: GenerationConfig = GenerationConfig(), progress: bool = True,
                       time_budget_s: float | None = None) -> int:
    """Answer every (prompt, temperature, sample) not yet in `out_dir` with `responder`; returns
    how many were written. Sample i of every prompt comes before sample i + 1, and prompts are
    sorted by length within a (temperature, sample) so a batch pads little.
    `time_budget_s`: stop after the batch during which this many seconds have passed."""
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = {r["key"] for r in read_responses(out)}
    todo = [(p, t, i) for t in cfg.temperatures for i in range(cfg.samples if t > 0 else 1) for p in prompts
            if prompt_key(p, t, i) not in done and in_part(prompt_key(p, t, i), cfg.part)]
    if not todo:
        return 0
    encoded = {p: responder.encode(p.text) for p in {p for p, _, _ in todo}}
    todo.sort(key=lambda pti: (pti[1], pti[2], len(encoded[pti[0]])))
    shard_no = max((int(f.name.split(".")[0].split("-")[1]) for f in response_shards(out)), default=-1) + 1
    written = in_shard = 0
    bar = tqdm(total=len(todo), desc="generate", unit="resp", disable=not progress, dynamic_ncols=True)
    f = None
    start = time.monotonic()
    try:
        for lo in range(0, len(todo), cfg.batch):
            chunk = todo[lo:lo + cfg.batch]
            temp = chunk[0][1]
            same = [pti for pti in chunk if pti[1] == temp]  # a batch never mixes temperatures
            rest = [pti for pti in chunk if pti[1] != temp]
            for group in (same, rest):
                if not group:
                    continue
                keys = [prompt_key(p, t, i) for p, t, i in group]
                seeds = [response_seed(cfg.seed, k) for k in keys]
                answers = responder.answer([encoded[p] for p, _, _ in group], group[0][1], seeds, cfg.max_new_tokens)
                if f is None or in_shard >= cfg.shard_records:
                    if f is not None:
                        f.close()
                    suffix = f"-p{cfg.part[0]}" if cfg.part[1] > 1 else ""  # parts never share a file
                    f = open(out / f"responses-{shard_no:05d}{suffix}.jsonl", "a", encoding="utf-8")
                    shard_no, in_shard = shard_no + 1, 0
                lines = [json.dumps({"key": k, "source": p.source, "temperature": t, "sample": i, "prompt": p.text,
                                     "prompt_ids": encoded[p], "response_ids": ids, "finished": fin})
                         for k, (p, t, i), (ids, fin) in zip(keys, group, answers)]
                f.write("\n".join(lines) + "\n")
                f.flush()
                written += len(group)
                in_shard += len(group)
                bar.update(len(group))
            if time_budget_s is not None and time.monotonic() - start >= time_budget_s:
                break
    finally:
        if f is not None:
            f.close()
        bar.close()
    return written


SYNTH_KINDS = (
    ("self:chat", "question or request about everyday life, science, history, writing or advice"),
    ("self:code", "programming task or question (for example in Python, JavaScript or SQL)"),
)
SYNTH_TEMPLATE = ("Here is an example of a request a user sent to an AI assistant:\n\n{seed}\n\n"
                  "Write one new {kind} that a user might send. Make it different from the example. "
                  "Reply with the request only.")


def first_question(text: str) -> str:
    """The first non-empty line of a generated request, without quotes or a 'Question:' label;
    "" when that line ends in a colon (a preamble such as "Here is a new request:", not one)."""
    for line in text.splitlines():
        line = re.sub(r"^\s*(\*\*)?(new )?(question|request|task|user|prompt)\s*\d*\s*:?(\*\*)?\s*:?\s*", "",
                      line.strip(), flags=re.I).strip().strip('"“”').strip()
        if line:
            return "" if line.endswith(":") else line
    return ""


def synthesize_prompts(responder: Responder, seeds: list[Prompt], n: int, *, batch: int = 8, max_new_tokens: int = 64,
                       seed: int = 0, min_chars: int = 15, exclude: Iterable[str] = (),
                       progress: bool = True) -> list[Prompt]:
    """Up to `n` distinct user requests written by the target itself (T = 1, through
    `responder`: transformers or the deployed engine), each asked for with a random alpaca seed
    task and alternately a chat or a code kind; none equal to a seed or to a text in `exclude`."""
    from tqdm import tqdm

    if not seeds:
        raise DataError("synthesize_prompts: no seed tasks")
    rng = random.Random(seed)
    out: list[Prompt] = []
    seen = {s.text for s in seeds} | set(exclude)
    bar = tqdm(total=n, desc="self-prompts", unit="prompt", disable=not progress, dynamic_ncols=True)
    attempts = 0
    while len(out) < n and attempts < 4 * n + batch:
        jobs = []
        for _ in range(batch):
            source, kind = SYNTH_KINDS[attempts % len(SYNTH_KINDS)]
            jobs.append((source, responder.encode(SYNTH_TEMPLATE.format(seed=rng.choice(seeds).text, kind=kind)),
                         seed * 1_000_003 + attempts))
            attempts += 1
        answers = responder.answer([ids for _, ids, _ in jobs], 1.0, [s for _, _, s in jobs], max_new_tokens)
        for (source, _, _), (ids, _) in zip(jobs, answers):
            q = first_question(responder.decode(ids))
            if len(q) >= min_chars and q not in seen and len(out) < n:
                seen.add(q)
                out.append(Prompt(q, source))
                bar.update()
    bar.close()
    return out


def write_prompts(prompts: Iterable[Prompt], path: str | Path) -> None:
    """JSON Lines {text, source}: `read_prompts` reads it back."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps({"text": p.text, "source": p.source}) + "\n" for p in prompts),
                          encoding="utf-8")


# --- 3. Target states: cached or on the fly ---------------------------------------------------------


def target_states(target: TargetModel, tokens: torch.Tensor, layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the target over tokens [B, T] (right-padded; causal, so padding never
    reaches real rows) -> features [B, T, m·d] (raw, at `layer_ids`) and final_hidden [B, T, d]
    (the last hidden state after the target's final norm, captured from `target.norm`)."""
    captured = {}
    handle = target.norm.register_forward_hook(lambda mod, inp, out: captured.__setitem__("h", out))
    try:
        B, T = tokens.shape
        dev = target.embed_tokens.weight.device
        with torch.inference_mode():
            _, feats = _cache_on(target, B, T, dev).run(target, tokens.to(dev), 0, tuple(layer_ids))
    finally:
        handle.remove()
    return feats, captured["h"]


def _cache_on(target: TargetModel, batch: int, length: int, device) -> Any:
    cache = target.new_cache(batch, length)
    cache.k, cache.v = cache.k.to(device), cache.v.to(device)
    return cache


def record_tokens(rec: dict[str, Any], max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T] and response mask [T] of a response record (cut to max_len)."""
    ids = list(rec["prompt_ids"]) + list(rec["response_ids"])
    mask = [False] * len(rec["prompt_ids"]) + [True] * len(rec["response_ids"])
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def pad_right(tokens: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sequences [T_i] -> [B, max T_i], right-padded with id 0 (causal: padding never reaches real rows)."""
    T = max(len(t) for t in tokens)
    return torch.stack([torch.cat([t, t.new_zeros(T - len(t))]) for t in tokens])


def usable(rec: dict[str, Any], max_len: int | None = None) -> bool:
    """At least one anchor: two response tokens inside max_len."""
    _, mask = record_tokens(rec, max_len)
    return bool((mask[:-1] & mask[1:]).any())


def target_fingerprint(target: TargetModel, layer_ids: Sequence[int]) -> str:
    h = hashlib.sha256(json.dumps({"cfg": target.cfg.to_dict(), "layers": list(layer_ids)}, sort_keys=True).encode())
    for t in (target.norm.weight, target.lm_head.weight[:16], target.layers[0].self_attn.q_proj.weight[:4]):
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def records_fingerprint(records: Sequence[dict[str, Any]]) -> str:
    return hashlib.sha256("\n".join(r["key"] for r in records).encode()).hexdigest()[:16]


class StateSource(Protocol):
    """Where the target's states come from (`target_states`' contract)."""

    layer_ids: tuple[int, ...]
    compute: str  # recorded in a cache, which never mixes two: "fp32", "bf16" (torch) or "engine"

    def states(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fingerprint(self) -> str: ...


class TorchStates:
    """`StateSource` of our torch `TargetModel`; compute "bf16" runs its matmuls under bf16
    autocast (residual stream in fp32; faster on a CPU with bf16 instructions)."""

    def __init__(self, target: TargetModel, layer_ids: Sequence[int], compute: str = "fp32"):
        self.target, self.layer_ids, self.compute = target.requires_grad_(False).eval(), tuple(layer_ids), compute

    def states(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.target.embed_tokens.weight.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.compute == "bf16"):
            feats, hidden = target_states(self.target, tokens, self.layer_ids)
        return feats.float(), hidden.float()

    def fingerprint(self) -> str:
        return target_fingerprint(self.target, self.layer_ids)


class OnTheFlySource:
    """`SequenceSource` that runs the target for each sequence it is asked for (no cache)."""

    def __init__(self, states: StateSource, records: Sequence[dict[str, Any]], max_len: int | None = None):
        self.source, self.max_len = states, max_len
        self.records = [r for r in records if usable(r, max_len)]
        if not self.records:
            raise DataError("no usable training sequences (every response has fewer than two tokens)")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> TrainSequence:
        tokens, mask = record_tokens(self.records[i], self.max_len)
        with torch.inference_mode():
            feats, hidden = self.source.states(tokens[None])
        return TrainSequence(tokens, mask, feats[0].clone(), hidden[0].clone())

    def fingerprint(self) -> str:
        return records_fingerprint(self.records)


def cache_features(states: StateSource, records: Sequence[dict[str, Any]], cache_dir: str | Path,
                   max_len: int | None = None, batch: int = 1, shard_rows: int = 1 << 18,
                   progress: bool = True) -> int:
    """Run the target once per record not yet cached and store fp16 features and final-normed
    last hidden states in `cache_dir/feats-NNNNN.safetensors` + `index.jsonl`. Resumable: an
    index entry is written only after its shard is complete. Returns the records added.
    The source's `compute` is recorded, and a cache never mixes two."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    meta = {"layer_ids": list(states.layer_ids), "target": states.fingerprint(), "dtype": "float16",
            "final_hidden": "after the target's final norm (lm_head of it = target logits)", "max_len": max_len,
            "compute": states.compute}
    meta_path = cache / "cache_meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        diff = [k for k in ("layer_ids", "target", "max_len", "compute") if old.get(k, "fp32") != meta[k]]
        if diff:
            raise ConfigError(f"{cache}: the cache was built with different {diff} "
                              f"({ {k: old.get(k) for k in diff} } vs { {k: meta[k] for k in diff} }); "
                              "use a new cache directory")
    else:
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    index = _read_index(cache)
    done = {e["key"] for e in index}
    todo = [r for r in records if r["key"] not in done and usable(r, max_len)]
    shard_no = 1 + max((e["shard"] for e in index), default=-1)
    bar = tqdm(total=len(todo), desc="features", unit="seq", disable=not progress, dynamic_ncols=True)
    buf_f, buf_h, buf_t, entries, rows = [], [], [], [], 0

    def flush():
        nonlocal buf_f, buf_h, buf_t, entries, rows, shard_no
        if not entries:
            return
        name = f"feats-{shard_no:05d}.safetensors"
        save_file({"features": torch.cat(buf_f), "final_hidden": torch.cat(buf_h), "tokens": torch.cat(buf_t)},
                  str(cache / name))
        with open(cache / "index.jsonl", "a") as f:
            f.write("".join(json.dumps({**e, "shard": shard_no}) + "\n" for e in entries))
        shard_no += 1
        buf_f, buf_h, buf_t, entries, rows = [], [], [], [], 0

    todo.sort(key=lambda r: len(r["prompt_ids"]) + len(r["response_ids"]))  # little padding per batch
    for lo in range(0, len(todo), batch):
        group = todo[lo:lo + batch]
        toks = [record_tokens(r, max_len) for r in group]
        padded = pad_right([t for t, _ in toks])  # [B, T]
        with torch.inference_mode():
            feats, hidden = states.states(padded)
        for r, (t, m), f_, h_ in zip(group, toks, feats, hidden):
            n = len(t)
            f16, h16 = _to_fp16(f_[:n], r["key"]), _to_fp16(h_[:n], r["key"])
            entries.append({"key": r["key"], "offset": rows, "length": n, "prompt_len": int((~m).sum())})
            buf_f.append(f16.cpu())
            buf_h.append(h16.cpu())
            buf_t.append(t.to(torch.int32))
            rows += n
        bar.update(len(group))
        if rows >= shard_rows:
            flush()
    flush()
    bar.close()
    return len(todo)


def _to_fp16(x: torch.Tensor, key: str) -> torch.Tensor:
    big = float(x.abs().max()) if x.numel() else 0.0
    if big > FP16_MAX:
        raise DataError(f"record {key}: a target state reaches {big:.3g}, beyond fp16; cache in fp32 or clamp")
    return x.to(torch.float16)


def _read_index(cache: Path) -> list[dict[str, Any]]:
    path = cache / "index.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class FeatureCache:
    """`SequenceSource` over a directory written by `cache_features` (memory-mapped shards)."""

    def __init__(self, cache_dir: str | Path, layer_ids: Sequence[int] | None = None):
        from safetensors import safe_open

        self.dir = Path(cache_dir)
        meta_path = self.dir / "cache_meta.json"
        if not meta_path.exists():
            raise DataError(f"{cache_dir}: not a feature cache (no cache_meta.json); build it with "
                            "`scripts/train_drafter.py cache`")
        self.meta = json.loads(meta_path.read_text())
        if layer_ids is not None and list(layer_ids) != self.meta["layer_ids"]:
            raise ConfigError(f"{cache_dir}: cached target_layer_ids {self.meta['layer_ids']}, "
                              f"the drafter needs {list(layer_ids)}")
        self.index = _read_index(self.dir)
        if not self.index:
            raise DataError(f"{cache_dir}: the cache holds no sequence")
        self._open = safe_open
        self._files: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.index)

    def _file(self, shard: int):
        if shard not in self._files:
            self._files[shard] = self._open(str(self.dir / f"feats-{shard:05d}.safetensors"), framework="pt")
        return self._files[shard]

    def __getitem__(self, i: int) -> TrainSequence:
        e = self.index[i]
        f = self._file(e["shard"])
        sl = slice(e["offset"], e["offset"] + e["length"])
        tokens = f.get_slice("tokens")[sl].long()
        mask = torch.arange(e["length"]) >= e["prompt_len"]
        return TrainSequence(tokens, mask, f.get_slice("features")[sl], f.get_slice("final_hidden")[sl])

    def fingerprint(self) -> str:
        return hashlib.sha256(("\n".join(e["key"] for e in self.index) + self.meta["target"]).encode()).hexdigest()[:16]
