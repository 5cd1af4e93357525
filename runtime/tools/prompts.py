"""Prompt files, read without torch: the one loader of the commands, the benchmark scripts and
the drafter recipe.

Benchmark sets (`../shared/data/bench/*.jsonl`, records {"turns": [...]}) are read by
`read_prompt_file` / `bench_prompts`. Training prompts (`../shared/data/train`: GSM8K questions;
alpaca seed instructions + their first input; our own {text}) by `load_train_prompts`, which
refuses anything under a `bench` directory: those are evaluation prompts."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import DSparkError, InputError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
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


def default_bench_dir() -> Path:
    """../shared/data/bench beside the project checkout (or beside the working directory)."""
    for root in (PROJECT_ROOT, Path.cwd()):
        cand = root.parent / "shared" / "data" / "bench"
        if cand.is_dir():
            return cand
    return Path("../shared/data/bench")


def read_prompt_file(path: Path, n: int, skip: int = 0) -> list[str]:
    """The first turn of records skip..skip+n-1 of a JSON Lines file: benchmark records
    ({"turns": [...]}) or training records (GSM8K `question`, alpaca `instruction`, our own
    `text`; the user message only, never an answer)."""
    out = []
    # JSON Lines ends records at "\n" only: str.splitlines() would also cut at a U+2028 inside a string
    for no, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            text = rec["turns"][0] if "turns" in rec else prompt_of(rec)
        except (json.JSONDecodeError, KeyError, TypeError, IndexError, AttributeError):
            text = None
        if not isinstance(text, str) or not text:
            raise InputError(f"{path}:{no}: expected a JSON object with a 'turns' list (or a training record with "
                             "a 'question', 'instruction' or 'text')")
        if skip:
            skip -= 1
            continue
        out.append(text)
        if len(out) == n:
            break
    if not out:
        raise InputError(f"{path}: no prompts left after skipping the first records")
    return out


def bench_prompts(name: str, n: int, skip: int = 0, data_dir: Path | None = None) -> list[str]:
    """The first turn of records skip..skip+n-1 of the benchmark set `data_dir/name.jsonl`."""
    path = (data_dir or default_bench_dir()) / f"{name}.jsonl"
    if not path.exists():
        raise InputError(f"{path}: no such benchmark file (--data sets the folder)")
    return read_prompt_file(path, n, skip)
