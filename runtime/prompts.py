"""Training prompts, read without torch (the runtime's `dspark calibrate` needs them too):
`../shared/data/train` (GSM8K questions; alpaca seed instructions + their first input).
Anything under a `bench` directory is refused: those are evaluation prompts."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .errors import DSparkError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRAIN_DIR = PROJECT_ROOT.parent / "shared" / "data" / "train"
DEFAULT_TRAIN_FILES = ("gsm8k-train.jsonl", "alpaca-seed-tasks.jsonl")


class DataError(DSparkError):
    """Training data is missing, malformed, empty, or an evaluation set."""


@dataclass(frozen=True)
class Prompt:
    text: str  # the user message
    source: str  # e.g. "gsm8k-train", "alpaca-seed-tasks", "self:chat"


def refuse_bench(path: str | Path) -> Path:
    """The resolved path, or `DataError` if any directory on it is named `bench`."""
    p = Path(path).resolve()
    if "bench" in p.parts[:-1] or (p.is_dir() and p.name == "bench"):
        raise DataError(f"{path}: lies under a `bench` directory; those are evaluation prompts and must never "
                        "be used to train or calibrate a drafter (use ../shared/data/train)")
    return p


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSON Lines file (one JSON object a line; blank lines skipped)."""
    p = refuse_bench(path)
    if not p.is_file():
        raise DataError(f"{path}: no such file")
    out = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON Lines ({e.msg}); expected one JSON object per line") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{n}: not JSON Lines; expected a JSON object, got {type(rec).__name__}")
            out.append(rec)
    return out


def prompt_of(rec: dict[str, Any]) -> str | None:
    """The user message of a training record: GSM8K `question` (never the answer); alpaca
    `instruction` + its first non-empty `instances[].input`; our own `text` (self-generated)."""
    if isinstance(rec.get("question"), str):
        return rec["question"].strip()
    if isinstance(rec.get("instruction"), str):
        text = rec["instruction"].strip()
        instances = rec.get("instances") or []
        first = instances[0].get("input", "") if instances and isinstance(instances[0], dict) else ""
        if isinstance(first, str) and first.strip():
            text = f"{text}\n\n{first.strip()}"
        return text
    if isinstance(rec.get("text"), str):
        return rec["text"].strip()
    return None


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of one file; records without a usable field are dropped. Raises `DataError`
    for a bench path, a file that is not JSON Lines, or a file with no prompt at all."""
    recs = read_jsonl(path)
    stem = Path(path).name.removesuffix(".jsonl")
    prompts = []
    for rec in recs:
        text = prompt_of(rec)
        if text:
            prompts.append(Prompt(text, str(rec.get("source") or stem)))
    if not prompts:
        raise DataError(f"{path}: no prompts ({len(recs)} records, none with a non-empty `question`, "
                        "`instruction` or `text`)")
    return prompts


def load_train_prompts(paths: Sequence[str | Path] | None = None, limit: int | None = None,
                       skip: int = 0) -> list[Prompt]:
    """Prompts from `paths` (default: the two files of ../shared/data/train), de-duplicated,
    each file cut to its prompts skip..skip+limit-1 (so `skip` >= another call's `limit`
    gives prompts disjoint from that call's). Every path is checked before any is read."""
    paths = [Path(p) for p in (paths or [DEFAULT_TRAIN_DIR / f for f in DEFAULT_TRAIN_FILES])]
    for p in paths:
        refuse_bench(p)
    seen, out = set(), []
    for p in paths:
        for pr in read_prompts(p)[skip:None if limit is None else skip + limit]:
            if pr.text not in seen:
                seen.add(pr.text)
                out.append(pr)
    if not out:
        raise DataError(f"no training prompts in {[str(p) for p in paths]}" + (f" after skipping {skip}" if skip else ""))
    return out
