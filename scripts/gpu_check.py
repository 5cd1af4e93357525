"""The GPU check (scripts/gpu_check.sh runs it on a lent GPU, in under 8 minutes).

On SmolLM2-135M-shaped random weights (the real GGUF is too big to carry to the machine):
  identity  the CUDA-graph backend (dspark.export.cuda_graph_backend: the PyTorch reference
            graphs captured per bucket) and its eager twin against the PyTorch reference on
            the CPU: greedy identity in the sense of dspark.md §1; sampled runs token-identical
            between replayed graphs and eager launches
  timing    host time per DSpark cycle with and without graph replay, acceptance on the device
            or on the host; target alone vs DSpark
  sps       the SPS curve: verification steps per second for 1..γ+1 rows, replayed and eager
  cupy      the CuPy device the TensorRT backend uses (row scatter, capture, replay)
Writes gpu_check.json (and gpu_check.png when matplotlib is there) under --out.

--smoke runs a tiny model on the CPU stand-in device (no graphs are captured) to test this
script where there is no GPU. Exit codes: 0 all checks passed, 1 a check failed, 2 no GPU."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # factories: random weights for the model shapes

SMOLLM2 = dict(vocab=49152, hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, max_pos=8192, rope=100000.0)
TINY = dict(vocab=97, hidden=64, inter=136, layers=4, heads=4, kv_heads=2, max_pos=512, rope=10000.0)


def make_models(dims: dict, gamma: int, rank: int, seed: int = 0):
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
    return target, drafter


def stats_dict(backend) -> dict:
    return {k: vars(v) for k, v in backend.stats.items()}


def check_identity(ctx: dict, res: dict) -> None:
    from factories import reference_logits

    from dspark.export import TorchBackend
    from dspark.runtime import FixedLength, SamplingParams, generate
    from dspark.runtime.tools.parity import greedy_match

    target, drafter, a = ctx["target"], ctx["drafter"], ctx["args"]
    out = res["identity"] = {"prompts": [len(p) for p in ctx["prompts"]], "greedy": [], "sampled": []}
    for i, prompt in enumerate(ctx["prompts"]):
        params = SamplingParams(0.0, a.max_new_tokens)
        t0 = time.perf_counter()
        ref = generate(TorchBackend(target, None, a.max_seq), prompt, params, None).token_ids  # CPU, target alone
        logits = reference_logits(target, prompt, ref)
        row = {"prompt_tokens": len(prompt), "reference_s": round(time.perf_counter() - t0, 2)}
        for name, be in ctx["backends"].items():
            for sched_name, sched in (("dspark", FixedLength()), ("alone", None)):
                g = generate(be, prompt, params, sched)
                m = greedy_match(ref, g.token_ids, logits)
                row[f"{name}/{sched_name}"] = {"ok": m.ok, "verdict": str(m), "tau": g.stats.tau}
        out["greedy"].append(row)
        print(f"identity prompt {i}: {row}", flush=True)
    for seed in range(3):
        params = SamplingParams(1.0, a.max_new_tokens, seed)
        runs = {n: generate(be, ctx["prompts"][0], params, FixedLength()) for n, be in ctx["backends"].items()}
        toks = [r.token_ids for r in runs.values()]
        out["sampled"].append({"seed": seed, "identical": all(t == toks[0] for t in toks),
                               "tau": {n: r.stats.tau for n, r in runs.items()}})
    out["graph_stats"] = {n: stats_dict(be) for n, be in ctx["backends"].items()}
    out["ok"] = (all(v["ok"] for row in out["greedy"] for k, v in row.items() if isinstance(v, dict))
                 and all(s["identical"] for s in out["sampled"])
                 and not any(s["capture_failures"] for st in out["graph_stats"].values() for s in st.values()))


def check_timing(ctx: dict, res: dict) -> None:
    from dspark.runtime import FixedLength, SamplingParams, generate

    a, prompt = ctx["args"], ctx["prompts"][0]
    out = res["timing"] = {}
    params = SamplingParams(0.0, a.max_new_tokens)
    for name, be in ctx["backends"].items():
        generate(be, prompt, params, FixedLength())  # warm-up: every bucket of this run gets captured
        spec = generate(be, prompt, params, FixedLength())
        alone = generate(be, prompt, params, None)
        s = spec.stats
        out[name] = {
            "cycle_ms": 1e3 * (s.times["draft"] + s.times["verify"]) / max(s.cycles, 1),
            "draft_ms": 1e3 * s.times["draft"] / max(s.cycles, 1),
            "verify_ms": 1e3 * s.times["verify"] / max(s.cycles, 1),
            "tau": s.tau,
            "dspark_tok_s": s.to_dict(len(spec.token_ids))["decode_tokens_per_s"],
            "target_alone_tok_s": alone.stats.to_dict(len(alone.token_ids))["decode_tokens_per_s"],
            "target_alone_step_ms": 1e3 * alone.stats.times["decode"] / max(alone.stats.cycles, 1),
        }
        print(f"timing {name}: {out[name]}", flush=True)
    out["ok"] = True


def check_sps(ctx: dict, res: dict) -> None:
    a = ctx["args"]
    out = res["sps"] = {}
    tokens = np.resize(np.asarray(ctx["prompts"][-1], np.int64), (1, a.gamma + 1))  # [1, γ+1], whatever the prompts
    starts = np.array([min(256, a.max_seq // 2)])  # [1]
    for name, be in ctx["backends"].items():
        if name.endswith("host-accept"):
            continue  # the same target calls as "graphs"
        curve = {}
        for S in range(1, a.gamma + 2):
            for _ in range(3):  # capture and warm up this bucket
                be.target(tokens[:, :S], starts)
            t0 = time.perf_counter()
            for _ in range(a.reps):
                be.target(tokens[:, :S], starts)  # same rows each time: the KV writes are idempotent
            curve[S] = a.reps / (time.perf_counter() - t0)
        out[name] = curve
        print(f"sps {name}: " + ", ".join(f"{s}: {v:.0f}/s" for s, v in curve.items()), flush=True)
    out["ok"] = True


def check_cupy(ctx: dict, res: dict) -> None:
    """The CuPy device of the TensorRT backend: row scatter from device positions, captured and replayed."""
    from dspark.runtime.backends.gpu.cupy_device import CupyDevice

    dev = CupyDevice()
    rng = np.random.default_rng(0)
    cache = dev.zeros((1, 3, 64, 8), np.float32)
    rows_h = rng.standard_normal((1, 3, 4, 8)).astype(np.float32)
    rows, positions = dev.zeros(rows_h.shape, np.float32), dev.zeros((1, 6), np.int64)
    dev.upload(rows, rows_h)
    dev.upload(positions, np.array([[10, 11, 12, 13, 0, 0]]))  # n = 4 rows; the rest of the row is ignored
    dev.write_rows(cache, rows, positions)
    want = np.zeros((1, 3, 64, 8), np.float32)
    want[:, :, 10:14] = rows_h
    eager_ok = bool(np.array_equal(dev.download(cache), want))
    replay, outputs = dev.capture(lambda: (dev.write_rows(cache, rows, positions), {"cache": cache})[1])
    dev.upload(positions, np.array([[40, 41, 42, 43, 0, 0]]))  # new lengths, same addresses
    replay()
    want[:, :, 40:44] = rows_h
    replay_ok = bool(np.array_equal(dev.download(outputs["cache"]), want))
    t0 = time.perf_counter()
    for _ in range(1000):
        replay()
    dev.stream.synchronize()
    res["cupy"] = {"device": dev.name, "compute_capability": list(dev.info.compute), "write_rows_ok": eager_ok,
                   "replay_ok": replay_ok, "replay_us": 1e3 * (time.perf_counter() - t0), "ok": eager_ok and replay_ok}
    print(f"cupy: {res['cupy']}", flush=True)


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        res["plot"] = "matplotlib is not installed: no png"
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in res.get("sps", {}).items():
        if isinstance(curve, dict):
            ax1.plot([int(s) for s in curve], list(curve.values()), marker="o", label=name)
    ax1.set(xlabel="rows verified (1 + ℓ)", ylabel="verification steps / s", title="SPS curve (batch 1)")
    if ax1.lines:
        ax1.legend()
    t = {k: v for k, v in res.get("timing", {}).items() if isinstance(v, dict)}
    if t:
        names = list(t)
        ax2.bar([f"{n}\ncycle" for n in names] + [f"{n}\nalone step" for n in names],
                [t[n]["cycle_ms"] for n in names] + [t[n]["target_alone_step_ms"] for n in names])
        ax2.set(ylabel="host ms", title="host time per DSpark cycle / target step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "out" / "gpu_check"))
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU stand-in device (tests this script)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--reps", type=int, default=50, help="calls per SPS point")
    args = p.parse_args(argv)
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
    if not args.smoke and not torch.cuda.is_available():
        res["status"] = "no GPU: torch.cuda.is_available() is False; nothing was checked"
        save()
        print(f"gpu_check: {res['status']}", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke:
        res["gpu"] = torch.cuda.get_device_name(0)
        res["cuda"] = torch.version.cuda
    torch.manual_seed(0)
    dims = TINY if args.smoke else SMOLLM2
    args.gamma, args.max_seq = 7, 128 if args.smoke else 2048
    chunk, min_context = (8, 16) if args.smoke else (512, 128)
    if args.smoke:
        args.max_new_tokens, args.reps = min(args.max_new_tokens, 24), min(args.reps, 3)
    res["config"] = {"dims": dims, "gamma": args.gamma, "max_seq": args.max_seq, "prefill_chunk": chunk,
                     "min_context": min_context, "max_new_tokens": args.max_new_tokens}
    t0 = time.perf_counter()
    from dspark.export.cuda_graph_backend import cuda_graph_backend

    target, drafter = make_models(dims, args.gamma, rank=16 if args.smoke else 256)
    rng = np.random.default_rng(0)
    lengths = (5, 13, 30) if args.smoke else (24, 200, 700)  # 700 > one prefill chunk; contexts cross buckets
    prompts = [rng.integers(5, dims["vocab"], n).tolist() for n in lengths]
    backends = {name: cuda_graph_backend(target, drafter, args.max_seq, device, graphs=graphs, prefill_chunk=chunk,
                                         min_context=min_context, device_acceptance=None if on_device else False)
                for name, graphs, on_device in (("graphs", True, True), ("eager", False, True),
                                                ("graphs-host-accept", True, False))}
    res["acceptance_on_device"] = {name: be.accepts_on_device for name, be in backends.items()}
    ctx = {"args": args, "target": target, "drafter": drafter, "prompts": prompts, "backends": backends}
    res["setup_s"] = round(time.perf_counter() - t0, 1)
    checks = [check_identity, check_timing, check_sps] + ([] if args.smoke else [check_cupy])
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
    res["ok"] = all(res[c.__name__.removeprefix("check_")].get("ok") for c in checks)
    save()
    print(f"gpu_check: {'all checks passed' if res['ok'] else 'SOME CHECKS FAILED'}; results in {out}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
