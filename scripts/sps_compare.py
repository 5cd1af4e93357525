"""The target's SPS curve of several bundles, measured interleaved: which precision keeps
verification cheap on this machine, whole graph (attention and KV cache included).

One request (slots 1, the target graph ONNX Runtime runs), `--context` committed positions;
each round times one call of S = 1..`--max-s` query rows on every bundle in turn, and the median
over rounds is kept, so a slow phase of a shared machine falls on every bundle alike.

    python scripts/sps_compare.py engines/smollm2 engines/smollm2-gguf --threads 2 --rounds 20
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from dspark.runtime import Engine
from dspark.runtime.manifest import Manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-s", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    backends = {}
    for b in args.bundles:
        be = Engine.load(b, max_seq=args.context + args.max_s + 1, threads=args.threads).backend
        vocab = Manifest.load(b).target.vocab_size
        be.target(rng.integers(0, vocab, (1, args.context)), np.zeros(1, np.int64))  # the committed rows
        backends[b.name] = (be, vocab)
    sizes = range(1, args.max_s + 1)
    times = {(n, s): [] for n in backends for s in sizes}
    load0 = os.getloadavg()[0]
    start = np.array([args.context], np.int64)
    for r in range(args.rounds):
        for n in (list(backends) if r % 2 == 0 else list(backends)[::-1]):
            be, vocab = backends[n]
            for s in sizes:
                tokens = rng.integers(0, vocab, (1, s))
                t0 = time.perf_counter()
                be.target(tokens, start)
                times[(n, s)].append(time.perf_counter() - t0)
    spread = np.median([np.percentile(v, 90) / np.percentile(v, 10) for v in times.values()])
    print(f"threads {args.threads}, context {args.context}, {args.rounds} rounds; load average {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}; disturbance: median p90/p10 of a cell {spread:.2f}\n")
    print("| bundle | " + " | ".join(f"SPS({s})" for s in sizes) + f" | {args.max_s} rows cost, in steps |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for n in backends:
        t = [float(np.median(times[(n, s)])) for s in sizes]
        print(f"| {n} | " + " | ".join(f"{1 / x:.1f}" for x in t) + f" | {t[-1] / t[0]:.2f} |")


if __name__ == "__main__":
    main()
