"""The GPU check (scripts/gpu_check.sh runs it on a lent GPU, in under 7 minutes).

Models: the real target (the SmolLM2-135M-Instruct GGUF, dequantised to fp32, `--gguf`) with
the shipped drafter and real prompts (`--prompts`, token ids written by scripts/gpu_prep.sh);
without `--gguf`, SmolLM2-shaped random weights and random prompts. The checks (gpu_checks.py),
in the order they run (each one's results are saved as soon as it ends):
  identity     greedy DSpark with replayed graphs, with eager launches and with acceptance on the
               host, and the target alone, against each other and against the PyTorch reference
               on the CPU (dspark.md §1); sampled runs token-identical between graphs and eager
  concurrency  R requests at once for each R of --concurrency: tokens/s of DSpark and of the target
               alone, and greedy outputs against the solo runs
  timing       host launch time and wall time per DSpark cycle, replayed graphs vs eager (batch 1)
  throughput   target alone vs DSpark tokens/s at batch 1 on real prompts: τ and DSpark / (τ × alone)
  sps          verification steps per second for 1..γ+1 rows, at batch 1 (graphs and eager) and at
               each concurrency
  graph_time   device time of one replay of each captured graph, at batch 1 and the largest batch
  cupy         the CuPy device the TensorRT backend uses (row scatter, capture, replay)
Writes gpu_check.json (and gpu_check.png when matplotlib is there) under --out.

--smoke runs a tiny random model on the CPU stand-in device (no graphs are captured) to test this
script where there is no GPU; --cpu runs the given models there with small sizes (a tiny random
model without --gguf). When the real weights do not load, the error is recorded and the checks
run on random weights. Exit codes: 0 all checks passed, 1 a check failed (or the real weights
did not load), 2 no GPU."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # factories: random weights, reference logits
sys.path.insert(0, str(ROOT / "scripts"))

DRAFTER = ROOT / "export" / "drafters" / "smollm2-135m-instruct"
SMOLLM2 = dict(vocab=49152, hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, max_pos=8192, rope=100000.0)
TINY = dict(vocab=97, hidden=64, inter=136, layers=4, heads=4, kv_heads=2, max_pos=512, rope=10000.0)


@dataclass(frozen=True)
class Sizes:
    max_new_tokens: int  # identity and concurrency runs
    bench_tokens: int  # the batch-1 tokens/s runs
    identity_prompts: int
    bench_prompts: int
    cpu_reference: int  # prompts also decoded by the PyTorch reference on the CPU
    reps: int  # calls per SPS point
    concurrency: tuple[int, ...]
    max_seq: int
    prefill_chunk: int
    min_context: int


GPU_SIZES = Sizes(128, 256, 4, 6, 2, 30, (1, 4, 16), 1024, 512, 128)
CPU_SIZES = Sizes(12, 16, 2, 2, 1, 2, (1, 4), 512, 64, 64)  # --cpu: the GPU path on the CPU stand-in
SMOKE_SIZES = Sizes(16, 24, 3, 2, 2, 3, (1, 4), 128, 8, 16)


@dataclass
class Models:
    target: Any  # TargetModel (fp32, on the CPU)
    drafter: Any  # Drafter
    prompts: list[list[int]]  # token ids
    labels: list[str]  # where each prompt came from
    stop_token_ids: tuple[int, ...] = ()
    source: dict = field(default_factory=dict)


def random_models(dims: dict, gamma: int, rank: int, n_prompts: int, lengths: tuple[int, ...], seed: int = 0) -> Models:
    """A random target (scaled like the test factories, so logits have real gaps) and an
    untrained drafter whose low-rank Markov head copies the previous token: random targets
    fall into repetition loops, where such a drafter gets accepted."""
    import torch
    from factories import randomize

    from dspark.export.drafter import init_drafter
    from dspark.export.target import TargetModel
    from dspark.runtime.config import TargetConfig

    cfg = TargetConfig(arch="llama", vocab_size=dims["vocab"], hidden_size=dims["hidden"],
                       intermediate_size=dims["inter"], num_layers=dims["layers"], num_heads=dims["heads"],
                       num_kv_heads=dims["kv_heads"], head_dim=dims["hidden"] // dims["heads"], rope_theta=dims["rope"],
                       rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=dims["max_pos"])
    target = randomize(TargetModel(cfg), seed).eval()
    drafter = init_drafter(target, num_layers=1, block_size=gamma, markov_rank=rank, mask_token_id=3, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    u = torch.randn(cfg.vocab_size, rank, generator=g)
    u /= u.norm(dim=1, keepdim=True)
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.copy_(30.0 * u)  # bias(prev, x) = 30 <u_x, u_prev>
        drafter.markov_head.markov_w2.weight.copy_(u)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(5, dims["vocab"], lengths[i % len(lengths)]).tolist() for i in range(n_prompts)]
    return Models(target, drafter, prompts, [f"random-{len(p)}" for p in prompts],
                  source={"weights": "random", "dims": dims})


def real_models(gguf: Path, drafter_dir: Path, prompts_file: Path) -> Models:
    """The GGUF target (dequantised to fp32 by the exporter's loader), the shipped drafter, and the
    prompts scripts/gpu_prompts.py tokenized."""
    from dspark.export.checkpoint import load_drafter
    from dspark.export.target_loader import load_target

    loaded = load_target(gguf)
    target = loaded.model
    drafter = load_drafter(drafter_dir, embeddings=(target.embed_tokens.weight, target.lm_head.weight))
    spec = json.loads(prompts_file.read_text())
    prompts = [p["ids"] for p in spec["prompts"]]
    labels = [f"{p['set']}-{p['index']}" for p in spec["prompts"]]
    stop = tuple(sorted(set(loaded.stop_token_ids) | set(spec["stop_token_ids"])))
    return Models(target, drafter, prompts, labels, stop,
                  {"weights": "real", "gguf": spec["source"], "drafter": drafter_dir.name})


def interleave(models: Models) -> list[int]:
    """Prompt indices alternating between the sets (gsm8k, mt-bench, gsm8k, ...)."""
    sets: dict[str, list[int]] = {}
    for i, label in enumerate(models.labels):
        sets.setdefault(label.rsplit("-", 1)[0], []).append(i)
    order, queues = [], list(sets.values())
    while any(queues):
        order += [q.pop(0) for q in queues if q]
    return order


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "out" / "gpu_check"))
    p.add_argument("--smoke", action="store_true", help="tiny random model on the CPU stand-in device")
    p.add_argument("--cpu", action="store_true", help="--gguf's models on the CPU stand-in device, small sizes")
    p.add_argument("--gguf", type=Path, help="the target GGUF (real weights); default: random weights")
    p.add_argument("--drafter", type=Path, default=DRAFTER, help="the drafter checkpoint (with --gguf)")
    p.add_argument("--prompts", type=Path, help="prompt token ids (scripts/gpu_prompts.py; with --gguf)")
    p.add_argument("--concurrency", help="comma-separated R values (default: 1,4,16 on a GPU)")
    args = p.parse_args(argv)
    if args.gguf is not None and args.prompts is None:
        p.error("--gguf needs --prompts (scripts/gpu_prep.sh writes .gpu/prompts.json)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "smoke": args.smoke,
                 "python": platform.python_version()}

    def save() -> None:
        (out / "gpu_check.json").write_text(json.dumps(res, indent=2, default=str) + "\n")

    try:
        import torch
    except ImportError as e:
        res["status"] = f"torch is not installed: {e}"
        save()
        print(f"gpu_check: {res['status']}", file=sys.stderr)
        return 2
    res["torch"] = torch.__version__
    on_cpu = args.smoke or args.cpu
    if not on_cpu and not torch.cuda.is_available():
        res["status"] = "no GPU: torch.cuda.is_available() is False; nothing was checked"
        save()
        print(f"gpu_check: {res['status']}", file=sys.stderr)
        return 2
    if not on_cpu:
        res["gpu"] = torch.cuda.get_device_name(0)
        res["cuda"] = torch.version.cuda
    torch.manual_seed(0)
    sizes = SMOKE_SIZES if args.smoke else CPU_SIZES if args.cpu else GPU_SIZES
    if args.concurrency:
        sizes = replace(sizes, concurrency=tuple(int(r) for r in args.concurrency.split(",")))
    t0 = time.perf_counter()
    gamma = 7
    n_prompts = max(max(sizes.concurrency), sizes.identity_prompts, sizes.bench_prompts)
    models = None
    if args.gguf is not None:
        try:
            models = real_models(args.gguf, args.drafter, args.prompts)
        except Exception as e:  # noqa: BLE001 — say so, and measure on random weights rather than nothing
            res["real_weights_error"] = f"{type(e).__name__}: {e}"
            res["real_weights_traceback"] = traceback.format_exc()
            print(f"gpu_check: the real weights did not load ({res['real_weights_error']}); random weights instead",
                  file=sys.stderr, flush=True)
    if models is None and on_cpu:
        models = random_models(TINY, gamma, rank=16, n_prompts=n_prompts, lengths=(5, 13, 30))
    elif models is None:
        models = random_models(SMOLLM2, gamma, rank=256, n_prompts=n_prompts, lengths=(24, 200, 700))
    res["config"] = {"sizes": asdict(sizes), "gamma": models.drafter.cfg.block_size, "models": models.source,
                     "prompts": [f"{lab} ({len(q)} tokens)" for lab, q in zip(models.labels, models.prompts)]}
    res["setup_s"] = round(time.perf_counter() - t0, 1)
    save()
    from gpu_checks import CHECKS, Context, plot

    ctx = Context(sizes, models, "cpu" if on_cpu else "cuda", interleave(models))
    checks = [c for c in CHECKS if not (on_cpu and c.__name__ == "check_cupy")]
    for check in checks:
        name = check.__name__.removeprefix("check_")
        t0 = time.perf_counter()
        try:
            check(ctx, res)
        except Exception as e:  # noqa: BLE001 — record it, go on with the other checks
            res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(f"{name}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        res[name]["seconds"] = round(time.perf_counter() - t0, 1)
        save()
    plot(res, out / "gpu_check.png")
    res["ok"] = all(res[c.__name__.removeprefix("check_")].get("ok") for c in checks) and "real_weights_error" not in res
    res["seconds"] = round(sum(res[c.__name__.removeprefix("check_")]["seconds"] for c in checks) + res["setup_s"], 1)
    save()
    print(f"gpu_check: {'all checks passed' if res['ok'] else 'SOME CHECKS FAILED'}; results in {out}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
