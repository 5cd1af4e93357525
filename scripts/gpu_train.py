"""The drafter's GPU route (issue 24 item 3): on a lent GPU, the target writes responses to the
training prompts and the drafter trains on them, within one device call, and what it made comes
back under $OUT within the device tool's limits (at most 8 files of 16 MiB).

On the GPU the target is the GGUF as transformers loads it, computing in bf16 (--gen-dtype): not
the CPU graph's int8 arithmetic that the default bundle deploys. Its responses and features are close to
the deployed target's, not equal; τ is measured afterwards on the deployed CPU graph
(docs/drafter.md, "The GPU route").

Stages, each one `scripts/train_drafter.py` subcommand run in this process:
  (--data)   responses already written, e.g. the deployed engine's in scripts/drafter_data/smollm2,
             which every device call carries with the tree: copied into the work directory
  generate   transformers on the GPU, batched, T = 0 and 1, for --gen-minutes (0: none)
  train      on every response of the work directory, warm-started from --init-from, features
             on the fly (the target runs on the GPU in every step: no cache), over --draft-vocab
             ids, for --train-minutes
  export     the newest checkpoint as a DeepSpec checkpoint (bf16)
Then the checkpoint and the responses generated here (xz shards) are packed into result.tar split into parts
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
import shutil
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
    why = None
    try:
        rc = train_drafter.main(argv)
    except SystemExit as e:  # a subcommand's refusal of bad input names what to do: keep its message
        rc, why = (e.code, None) if isinstance(e.code, int) else (1, str(e.code))
    report["stages"][name] = {"seconds": round(time.monotonic() - t0, 1), "rc": rc}
    if rc:
        raise RuntimeError(f"{name}: {why}" if why else f"{name} exited {rc}")


def _take_data(src: Path, data: Path) -> set[str]:
    """Copy the response shards of data directory `src` (and the target it names) into `data`,
    where generation adds to them and training reads them all; returns the shards' names."""
    shards = sorted((src / "responses").glob("responses-*.jsonl*"))
    (data / "responses").mkdir(parents=True, exist_ok=True)
    for shard in shards:
        shutil.copyfile(shard, data / "responses" / shard.name)
    if (src / "target.json").exists():  # train refuses the data if --target is another model
        shutil.copyfile(src / "target.json", data / "target.json")
    return {shard.name for shard in shards}


def _tokens(recs: list[dict]) -> int:
    return sum(len(r["response_ids"]) for r in recs)


def _pack(work: Path, out: Path, given: set[str]) -> list[str]:
    """DIR/drafter and the response shards written here (xz; not those of --data) ->
    out/result.tar.partNN (+ result.sha256)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(work / "drafter", arcname="drafter")
        for shard in sorted(f for f in (work / "data" / "responses").glob("responses-*.jsonl") if f.name not in given):
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
    p.add_argument("--data", help="responses already written (a data directory of `train_drafter.py generate`, "
                   "e.g. scripts/drafter_data/smollm2): trained on with those generated here")
    p.add_argument("--gen-minutes", type=float, default=4.0, help="generation budget (default 4; 0 = none)")
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
    if args.data and not sorted((Path(args.data) / "responses").glob("responses-*.jsonl*")):
        p.error(f"--data {args.data}: no responses/responses-*.jsonl[.xz] in it; pass a data directory written "
                f"by `train_drafter.py generate` (e.g. scripts/drafter_data/smollm2)")
    if not args.data and args.gen_minutes <= 0:
        p.error("--gen-minutes 0 without --data: nothing to train on; pass --data DIR or a generation budget")

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
        from dspark.export.train_data import read_responses

        given = _take_data(Path(args.data), data) if args.data else set()
        before = read_responses(data / "responses") if (data / "responses").is_dir() else []
        if args.gen_minutes > 0:
            _stage("generate", ["generate", *common, "--data", str(data), "--prompts", *args.prompts,
                                "--skip", str(args.skip), "--self-prompts", "0", "--temperatures", "0", "1",
                                "--max-new-tokens", str(args.max_new_tokens), "--batch", str(args.gen_batch),
                                "--dtype", args.gen_dtype, "--seed", str(args.seed),
                                "--time-budget", f"{args.gen_minutes}m"], report)
        recs = read_responses(data / "responses")
        new_tokens = _tokens(recs) - _tokens(before)
        gen_s = report["stages"].get("generate", {}).get("seconds")
        report["data"] = {"responses": len(recs), "response_tokens": _tokens(recs), "given": args.data,
                          "generated_responses": len(recs) - len(before), "generated_tokens": new_tokens,
                          "tokens_per_s": round(new_tokens / max(gen_s, 1e-9), 1) if gen_s else None}
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
        report["files"] = _pack(work, out, given)
        report["ok"] = True
    except Exception as e:  # the report says which stage failed; what ran is kept
        report["status"] = f"{type(e).__name__}: {e}"
        print(f"gpu_train: failed: {report['status']}", file=sys.stderr)
    (out / "gpu_train.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
