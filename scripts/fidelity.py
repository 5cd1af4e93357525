"""How close a quantized target is to the fp32 one: top-1 agreement and mean KL(p_fp32 ‖ p_q)
over at least `--positions` positions of held-out text, each bundle's target graph as deployed
(ONNX Runtime, batch 1).

Text: GSM8K training conversations (question as the user turn, answer as the assistant's, in
the model's chat template) from record `--skip` on: past the prompts `dspark calibrate` and the
drafter's training read first. Never the benchmark sets. Every position of a conversation is
scored (the logits that predict its next token).

    python scripts/fidelity.py engines/smollm2 engines/smollm2-gguf --positions 2000
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dspark.runtime import Engine

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "train" / "gsm8k-train.jsonl"


def conversations(engine: Engine, path: Path, skip: int, positions: int, max_len: int) -> tuple[list[list[int]], int]:
    """(token ids of each conversation, the length of the prefix they share)."""
    if "bench" in path.parts:
        raise SystemExit(f"{path}: benchmark data is never used here")
    a, b = (engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in ("x", "y"))
    shared = next(i for i, (u, v) in enumerate(zip(a, b)) if u != v)
    out, total = [], 0
    with open(path) as f:
        for i, line in enumerate(f):
            if i < skip:
                continue
            r = json.loads(line)
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": r["question"]},
                                                {"role": "assistant", "content": r["answer"]}])[:max_len]
            out.append(ids)
            total += len(ids) - 1 - shared
            if total >= positions:
                return out, shared
    raise SystemExit(f"{path} has fewer than {positions} positions after record {skip}")


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", type=Path, help="the fp32 bundle")
    ap.add_argument("bundles", nargs="+", type=Path, help="bundles of the same target at other precisions")
    ap.add_argument("--positions", type=int, default=2000)
    ap.add_argument("--skip", type=int, default=6000, help="first GSM8K training record used")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args()
    engines = {b: Engine.load(b, max_seq=args.max_len, threads=args.threads) for b in [args.reference, *args.bundles]}
    texts, shared = conversations(engines[args.reference], args.data, args.skip, args.positions, args.max_len)
    stats = {b: [0, 0.0, 0] for b in args.bundles}  # agreeing positions, Σ KL, positions
    zero = np.zeros(1, np.int64)
    for ids in texts:
        x = np.asarray(ids, np.int64)[None]
        ref = log_softmax(engines[args.reference].backend.target(x, zero)[0][0, shared:-1])  # [S-1-shared, V]
        for b in args.bundles:
            q = log_softmax(engines[b].backend.target(x, zero)[0][0, shared:-1])
            s = stats[b]
            s[0] += int((q.argmax(-1) == ref.argmax(-1)).sum())
            s[1] += float((np.exp(ref) * (ref - q)).sum())
            s[2] += len(q)
    print(f"reference {args.reference.name}; {len(texts)} conversations of {args.data.name} from record "
          f"{args.skip}, scored after their shared {shared}-token prefix\n")
    print("| bundle | precision | positions | top-1 agreement | mean KL(fp32 ‖ q), nats |")
    print("|---|---|---|---|---|")
    for b, (agree, kl, n) in stats.items():
        print(f"| {b.name} | {engines[b].manifest.precision} | {n} | {agree / n:.4f} | {kl / n:.5f} |")


if __name__ == "__main__":
    main()
