"""The GPU check's prompts as token ids (scripts/gpu_prep.sh runs this here): the first turns of
GSM8K and MT-Bench records (../shared/data/bench, which does not travel to a lent machine), with
the target's chat template applied by its own tokenizer. Benchmark prompts serve measurement
only, never training."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SETS = ("gsm8k", "mt-bench")


def main(argv: list[str] | None = None) -> None:
    from dspark.export.target_loader import load_target
    from dspark.runtime.tools.prompts import bench_prompts

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gguf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--per-set", type=int, default=8, help="prompts of each set")
    args = p.parse_args(argv)
    loaded = load_target(args.gguf)
    tok = loaded.tokenizer
    prompts = []
    for name in SETS:
        for i, text in enumerate(bench_prompts(name, args.per_set)):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
            prompts.append({"set": name, "index": i, "ids": [int(t) for t in ids]})
    out = {"source": Path(args.gguf).name, "stop_token_ids": list(loaded.stop_token_ids), "prompts": prompts}
    Path(args.out).write_text(json.dumps(out) + "\n")
    print(f"gpu_prompts: {len(prompts)} prompts ({', '.join(SETS)}), "
          f"{min(len(q['ids']) for q in prompts)}..{max(len(q['ids']) for q in prompts)} tokens -> {args.out}")


if __name__ == "__main__":
    main()
