"""The draft vocabulary (after FR-Spec): the K token ids an exported drafter graph may
propose, and `restrict_vocab`, which cuts a drafter down to them. The K most frequent tokens
of the drafter's training responses when its checkpoint directory carries their counts
(`token_counts.json`, written by `train_drafter.py export`), else the K lowest ids: a
byte-level BPE assigns ids in merge order, which follows frequency in the tokenizer's own
corpus. The target's stop tokens are always kept, so that a draft can end where the answer
ends."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dspark.runtime.errors import ConfigError

from .drafter import Drafter

COUNTS_FILE = "token_counts.json"


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> np.ndarray:
    """Occurrences of every id in `sequences` -> [V] int64."""
    ids = np.fromiter((t for seq in sequences for t in seq), np.int64)
    return np.bincount(ids, minlength=vocab_size)[:vocab_size]


def count_responses(directory: str | Path, vocab_size: int) -> tuple[np.ndarray, str]:
    """([V] counts, source) over the response tokens of a training data directory's
    `responses/` shards (train_data.py)."""
    from .train_data import read_responses

    records = read_responses(Path(directory) / "responses")
    return (count_tokens((r["response_ids"] for r in records), vocab_size),
            f"the responses of {len(records)} training sequences")


def save_counts(directory: str | Path, counts: np.ndarray, source: str) -> Path:
    """Write the non-zero counts as {"source", "vocab_size", "tokens", "counts": {id: n}}."""
    nz = np.flatnonzero(counts)
    path = Path(directory) / COUNTS_FILE
    path.write_text(json.dumps({"source": source, "vocab_size": int(len(counts)), "tokens": int(counts.sum()),
                                "counts": {str(i): int(counts[i]) for i in nz}}) + "\n")
    return path


def load_counts(directory: str | Path, vocab_size: int) -> tuple[np.ndarray, str] | None:
    """([V] counts, source) from a drafter checkpoint directory, or None when it has none."""
    path = Path(directory) / COUNTS_FILE
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    if d["vocab_size"] != vocab_size:
        raise ConfigError(f"{path} counts a vocabulary of {d['vocab_size']} tokens, the target has {vocab_size}")
    counts = np.zeros(vocab_size, np.int64)
    for i, n in d["counts"].items():
        counts[int(i)] = n
    return counts, f"{d['tokens']} tokens of {d['source']}"


def choose_vocab(size: int, vocab_size: int, keep: Iterable[int],
                 counts: np.ndarray | None = None) -> torch.Tensor:
    """The `size` ids to draft from, sorted: `keep`, then by count (ties and unseen ids by id,
    i.e. BPE merge order; without counts by id alone). -> [size] int64."""
    if not 0 < size <= vocab_size:
        raise ConfigError(f"draft vocabulary of {size} tokens: expected 1..{vocab_size}")
    keep = sorted(set(keep))
    if len(keep) > size:
        raise ConfigError(f"draft vocabulary of {size} tokens cannot hold the {len(keep)} stop tokens")
    rank = np.zeros(vocab_size, np.int64) if counts is None else -counts.astype(np.int64)
    rank[keep] = np.iinfo(np.int64).min
    order = np.lexsort((np.arange(vocab_size), rank))  # by rank, then by id
    return torch.from_numpy(np.sort(order[:size]))


def restrict_vocab(drafter: Drafter, vocab: torch.Tensor) -> None:
    """Cut `drafter`'s LM head and Markov output projection, in place, to score only the ids in
    `vocab` [K] (sorted, distinct), kept as `drafter.vocab`: `Drafter.sequential` then maps its
    indices to these ids and widens its distributions to the whole vocabulary. On a CPU the
    [γ, d] x [d, V] LM head is the largest matmul of a drafter pass; proposals are then drawn
    from the K ids alone, which costs acceptance only where the target's token lies outside
    them. Acceptance corrects any proposal (dspark.md §1), so the output does not change."""
    weight = drafter.lm_head.weight[vocab].detach().clone()  # [K, d]
    drafter.lm_head = nn.Linear(drafter.cfg.hidden_size, len(vocab), bias=False)
    drafter.lm_head.weight = nn.Parameter(weight, requires_grad=False)
    if drafter.markov_head is not None:
        w2 = drafter.markov_head.markov_w2.weight[vocab].detach().clone()  # [K, r]
        drafter.markov_head.markov_w2 = nn.Linear(w2.shape[1], len(vocab), bias=False)
        drafter.markov_head.markov_w2.weight = nn.Parameter(w2, requires_grad=False)
    drafter.vocab = vocab
