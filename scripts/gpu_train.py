"""The drafter's GPU route (issue 24 item 3): on a lent GPU, the target writes responses to the
training prompts and the drafter trains on them, within one device call, and what it made comes
back under $OUT within the device tool's limits (at most 8 files of 16 MiB).

On the GPU the target is the GGUF as transformers loads it, computing in bf16 (--gen-dtype): not
the CPU graph's int8 arithmetic that the default bundle deploys. Its responses and features are close to
the deployed target's, not equal; τ is measured afterwards on the deployed CPU graph
(docs/drafter.md, "The GPU route").

Stages, each one `scripts/train_drafter.py` subcommand run in this process:
  generate   transformers on the GPU, batched, T = 0 and 1, for --gen-minutes
  train      warm-started from --init-from, features on the fly (the target runs on the GPU in
             every step: no cache), over --draft-vocab ids, for --train-minutes
  export     the newest checkpoint as a DeepSpec checkpoint (bf16)
Then the checkpoint and the responses (xz shards) are packed into result.tar split into parts
of at most 15 MiB, with result.sha256; gpu_train.json holds the timings and the losses.

Here, afterwards: `python scripts/gpu_train.py --unpack FILES_AT --to DIR` checks and unpacks.
Exit codes: 0 done, 1 a stage failed (gpu_train.json says which), 2 no GPU.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import platform
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
PART_BYTES = 15 * 1024 * 1024  # the tool returns files of at most 16 MiB
RESULT = "result.tar"


def _stage(name: str, argv: list[str], report: dict) -> None:
    import train_drafter

    print(f"gpu_train: {name}: {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    rc = train_drafter.main(argv)
    report["stages"][name] = {"seconds": round(time.monotonic() - t0, 1), "rc": rc}
    if rc:
        raise RuntimeError(f"{name} exited {rc}")


def _pack(work: Path, out: Path) -> list[str]:
    """DIR/drafter and the response shards (xz) -> out/result.tar.partNN (+ result.sha256)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(work / "drafter", arcname="drafter")
        for shard in sorted((work / "data" / "responses").glob("responses-*.jsonl")):
            raw = lzma.compress(shard.read_bytes(), preset=9)
            info = tarfile.TarInfo(f"responses/{shard.name}.xz")
            info.size, info.mtime = len(raw), int(shard.stat().st_mtime)
            tar.addfile(info, io.BytesIO(raw))
        tar.add(work / "run" / "log.jsonl", arcname="log.jsonl")
    data = buf.getvalue()
    names = []
    lines = [f"{hashlib.sha256(data).hexdigest()}  {RESULT}"]
    for i in range(0, len(data), PART_BYTES):
        name = f"{RESULT}.part{i // PART_BYTES:02d}"
        (out / name).write_bytes(data[i:i + PART_BYTES])
        lines.append(f"{hashlib.sha256(data[i:i + PART_BYTES]).hexdigest()}  {name}")
        names.append(name)
    (out / "result.sha256").write_text("\n".join(lines) + "\n")
    return names


def unpack(files_at: Path, to: Path) -> int:
    """Check every part and the whole against result.sha256, then unpack into `to`."""
    sums = dict(reversed(line.split("  ")) for line in (files_at / "result.sha256").read_text().splitlines())
    parts = sorted(n for n in sums if n != RESULT)
    missing = [n for n in parts if not (files_at / n).exists()]
    if missing:
        raise SystemExit(f"--unpack {files_at}: {', '.join(missing)} did not come back; rerun the device call")
    data = b"".join((files_at / n).read_bytes() for n in parts)
    if hashlib.sha256(data).hexdigest() != sums[RESULT]:
        raise SystemExit(f"--unpack {files_at}: the parts do not reassemble to result.tar (sha256 differs)")
    to.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(to, filter="data")
    print(f"unpacked {len(parts)} parts into {to}: drafter/, responses/, log.jsonl", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="the GGUF (or Hugging Face directory) the drafter is for")
    p.add_argument("--prompts", nargs="+", help="training prompt files (JSON Lines)")
    p.add_argument("--out", default=str(ROOT / "out" / "gpu_train"), help="where the results go ($OUT)")
    p.add_argument("--work", default="/tmp/dspark-gpu-train", help="data and run directory on the device")
    p.add_argument("--device", default="cuda", help="cuda (cpu: the tiny-scale rehearsal of the tests)")
    p.add_argument("--gen-minutes", type=float, default=4.0, help="generation budget (default 4)")
    p.add_argument("--train-minutes", type=float, default=4.0, help="training budget (default 4)")
    p.add_argument("--gen-batch", type=int, default=256, help="prompts per transformers generate call")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gen-dtype", choices=["bf16", "fp32"], default="bf16", help="transformers' compute dtype")
    p.add_argument("--skip", type=int, default=0, help="skip each prompt file's first N prompts (a later "
                   "call answers other prompts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=str(ROOT / "export" / "drafters" / "smollm2-135m-instruct"),
                   help="warm start (default: the shipped drafter; '' = random init)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="train over K ids, as exported (0 = all)")
    p.add_argument("--train-batch", type=int, default=32, help="sequences per step")
    p.add_argument("--steps", type=int, default=3000, help="the cosine schedule's length")
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--unpack", metavar="FILES_AT", help="here, afterwards: check and unpack a call's results")
    p.add_argument("--to", default="out/gpu_train", help="--unpack: into this directory")
    args = p.parse_args(argv)
    if args.unpack:
        return unpack(Path(args.unpack), Path(args.to))
    if not args.target or not args.prompts:
        p.error("--target and --prompts are required (scripts/gpu_train.sh passes them)")

    import torch

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"ok": False, "device": args.device, "torch": torch.__version__, "python": platform.python_version(),
                    "target": str(args.target), "stages": {},
                    "target_arithmetic": "the GGUF dequantized by transformers, bf16 on the device: not the "
                                         "deployed CPU graph's int8 arithmetic"}
    if args.device == "cuda" and not torch.cuda.is_available():
        report["status"] = "no GPU: torch.cuda.is_available() is False; this route runs on a lent GPU machine"
        (out / "gpu_train.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"gpu_train: {report['status']}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    common = ["--target", str(args.target), "--device", args.device]
    data, run = work / "data", work / "run"
    try:
        _stage("generate", ["generate", *common, "--data", str(data), "--prompts", *args.prompts,
                            "--skip", str(args.skip), "--self-prompts", "0", "--temperatures", "0", "1",
                            "--max-new-tokens", str(args.max_new_tokens), "--batch", str(args.gen_batch),
                            "--dtype", args.gen_dtype, "--seed", str(args.seed), "--time-budget", f"{args.gen_minutes}m"],
               report)
        from dspark.export.train_data import read_responses

        recs = read_responses(data / "responses")
        tokens = sum(len(r["response_ids"]) for r in recs)
        report["data"] = {"responses": len(recs), "response_tokens": tokens,
                          "tokens_per_s": round(tokens / max(report["stages"]["generate"]["seconds"], 1e-9), 1)}
        train = ["train", *common, "--data", str(data), "--run", str(run), "--no-cache", "--amp", "bf16" if
                 args.device == "cuda" else "none", "--batch", str(args.train_batch), "--steps", str(args.steps),
                 "--lr", str(args.lr), "--warmup", str(args.warmup), "--seed", str(args.seed),
                 "--draft-vocab", str(args.draft_vocab), "--time-budget", f"{args.train_minutes}m",
                 "--save-every", str(10 ** 9), "--log-every", "1"]
        if args.init_from:
            train += ["--init-from", args.init_from]
        _stage("train", train, report)
        log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        report["train"] = {"steps": log[-1]["step"], "sec_per_step": round(sum(r["sec_per_step"] for r in log) / len(log), 3),
                           "first": log[0], "last": log[-1]}
        _stage("export", ["export", "--run", str(run), "--out", str(work / "drafter"), "--target", str(args.target)],
               report)
        report["files"] = _pack(work, out)
        report["ok"] = True
    except Exception as e:  # the report says which stage failed; what ran is kept
        report["status"] = f"{type(e).__name__}: {e}"
        print(f"gpu_train: failed: {report['status']}", file=sys.stderr)
    (out / "gpu_train.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
