"""`dspark export`: target + drafter -> a bundle directory of ONNX graphs, tokenizer and
manifest. Written into a temporary directory and renamed at the end, so an interrupted
export never leaves a half bundle."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import onnx
import torch
from tqdm import tqdm

from dspark.runtime.calibration import CALIBRATION_FILE, Calibration, binding
from dspark.runtime.errors import CheckpointError
from dspark.runtime.manifest import Manifest
from dspark.runtime.tools.profile import QUICK, profile

from .checkpoint import load_drafter
from .draft_vocab import COUNTS_FILE, choose_vocab, load_counts
from .drafter import Drafter, init_drafter
from .onnx_export import export_drafter, export_target, graph_ops, greedy_from_cond, quiet_exporters
from .ort_graph import ACCURACY_LEVEL, embed_from_blocks, export_drafter_ort, export_target_ort, supports_ort_graph
from .portable_qdq import qdq_portable, traced_blocks
from .precision import dequantize_into, describe, resolve, target_weights
from .shared_weights import WEIGHTS_FILE, share_weights
from .target_loader import LoadedTarget, default_target_path, gguf_parsed_once, load_target

UNTRAINED = "untrained: random initialisation (1 layer, γ=7, vanilla Markov r=64, seed 0); no speedup expected"
# The project's trained drafter for the embedded default target (scripts/train_drafter.py), bf16, no embeddings.
SHIPPED_DRAFTER = Path(__file__).parent / "drafters" / "smollm2-135m-instruct"


def sha256(path: Path) -> str:
    """Of a file, or of a directory's files (a drafter checkpoint's, less the calibration it
    ships: that is fitted on the drafter, not part of it)."""
    h = hashlib.sha256()
    files = (sorted(p for p in path.rglob("*") if p.is_file() and p.name != CALIBRATION_FILE) if path.is_dir()
             else [path])
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def resolve_drafter(target: LoadedTarget, drafter_path: str | Path | None) -> tuple[Drafter, str, Path | None]:
    """(drafter, label, checkpoint it came from): the drafter at `drafter_path` (embeddings
    restored from the target if left out); without one, the shipped drafter for the embedded
    default target, or for any other target an untrained drafter (checkpoint None), labelled
    as such."""
    m = target.model
    if drafter_path is None:
        if target.source.resolve() != default_target_path().resolve() or not (SHIPPED_DRAFTER / "config.json").exists():
            return init_drafter(m), UNTRAINED, None
        drafter_path = SHIPPED_DRAFTER
    path = Path(drafter_path)
    if not path.exists():
        raise CheckpointError(f"drafter checkpoint {path} does not exist")
    drafter = load_drafter(path, embeddings=(m.embed_tokens.weight, m.lm_head.weight))
    drafter.cfg.check_against(m.cfg)
    if path == SHIPPED_DRAFTER:
        return drafter, f"the project's default drafter {path.name} (dspark.export/drafters; scripts/train_drafter.py)", path
    return drafter, str(path), path


def reusable_target(bundle: Path, target: LoadedTarget, drafter: Drafter, precision: str) -> Manifest:
    """The manifest of `bundle` if its target graphs can serve `drafter`: same target source
    (by hash), same precision and the same feature layers; otherwise a clear error."""
    old = Manifest.load(bundle)
    if old.source_hashes.get("target") != sha256(target.source):
        raise CheckpointError(f"--reuse-target {bundle}: its target graphs come from another target model")
    if old.precision != precision:
        raise CheckpointError(f"--reuse-target {bundle}: its target graphs are {old.precision}, "
                              f"not --precision {precision}")
    if tuple(old.drafter.target_layer_ids) != tuple(drafter.cfg.target_layer_ids):
        raise CheckpointError(f"--reuse-target {bundle}: its target graphs return the features of layers "
                              f"{list(old.drafter.target_layer_ids)}, the drafter needs {list(drafter.cfg.target_layer_ids)}")
    return old


def draft_vocab(size: int, target: LoadedTarget, drafter_source: Path | None) -> tuple[torch.Tensor, str]:
    """([size] ids, how they were chosen): see draft_vocab.py."""
    V = target.model.cfg.vocab_size
    found = load_counts(drafter_source, V) if drafter_source is not None else None
    if found is None:
        how = f"the {size} lowest ids (BPE merge order: the drafter has no {COUNTS_FILE})"
    else:
        how = f"the {size} most frequent ids in {found[1]}"
    return choose_vocab(size, V, target.stop_token_ids, None if found is None else found[0]), how + ", with the stop tokens"


def export_bundle(out: str | Path, target_path: str | Path | None = None, drafter_path: str | Path | None = None,
                  name: str | None = None, progress: bool = True, reuse_target: str | Path | None = None,
                  draft_vocab_size: int | None = None, precision: str = "auto", portable: bool = False,
                  quick_profile: bool = True) -> Manifest:
    """Write a bundle. `reuse_target`: a bundle of the same target whose target graphs are
    copied instead of exported again. `draft_vocab_size`: the drafter graphs propose only that
    many ids (draft_vocab.py). `precision`: the target's weights (precision.py; auto: gguf for a
    GGUF, else fp32). The torch model then holds the numbers the quantized weights stand for,
    so the portable graph and the drafter's shared embeddings are exported from them; the ONNX
    Runtime graph reads the blocks themselves. `portable`: also the standard-op target graph
    (target.onnx, what TensorRT and `--target-graph portable` read), which is traced (the
    slowest step) and is the only graph the ONNX Runtime CPU engine never needs.
    Every graph's weights are stored once, in weights.bin (shared_weights.py).
    The bundle is ready to schedule: the drafter's shipped calibration goes in when it was fitted
    on this drafter-target pair, and `quick_profile` measures this machine's SPS table
    (profile.QUICK); `dspark profile` and `dspark calibrate` redo either in full."""
    out = Path(out)
    steps = tqdm(total=7, desc="export", disable=not progress, unit="step")
    steps.set_postfix_str("loading target")
    with gguf_parsed_once():  # a GGUF source: transformers' reads and the blocks' read parse it once
        target = load_target(target_path)
        precision = resolve(precision, target.source)
        weights = target_weights(target.model, target.source, precision)
    if weights and not supports_ort_graph(target.model.cfg):
        raise CheckpointError(f"--precision {precision} runs only in the ONNX Runtime target graph, which this "
                              f"architecture cannot have (head size {target.model.cfg.head_dim}, odd); use "
                              f"--precision fp32")
    if not portable and not supports_ort_graph(target.model.cfg):
        portable = True  # the portable graph is then the only target graph
    dequantize_into(target.model, weights)
    steps.update()
    steps.set_postfix_str("loading drafter")
    drafter, label, drafter_source = resolve_drafter(target, drafter_path)
    reused = reusable_target(Path(reuse_target), target, drafter, precision) if reuse_target else None
    vocab, vocab_note = (None, None) if draft_vocab_size is None else draft_vocab(draft_vocab_size, target, drafter_source)
    steps.update()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with torch.inference_mode(False), torch.no_grad(), quiet_exporters():
            if reused is not None:
                steps.set_postfix_str("copying target graphs")
                graphs = {k: v for k, v in reused.graphs.items() if k.startswith("target")}
                for f in graphs.values():
                    _copy_graph(Path(reuse_target) / f, tmp / f)
                steps.update(2)
            else:
                graphs = {}
                if portable:
                    steps.set_postfix_str("exporting the portable target graph")
                    export_target(target.model, drafter.cfg.target_layer_ids, tmp / "target.onnx")
                    graphs["target"] = "target.onnx"
                steps.update()
                if supports_ort_graph(target.model.cfg):
                    steps.set_postfix_str("writing ONNX Runtime target graph")
                    export_target_ort(target.model, drafter.cfg.target_layer_ids, tmp / "target_ort.onnx", weights)
                    graphs["target_ort"] = "target_ort.onnx"
                steps.update()
            steps.set_postfix_str("exporting drafter graph")
            export_drafter(drafter, tmp / "drafter.onnx", vocab=vocab)
            graphs["drafter"] = "drafter.onnx"
            export_drafter_ort(tmp / "drafter.onnx", tmp / "drafter_ort.onnx")
            graphs["drafter_ort"] = "drafter_ort.onnx"
            # the same int8 graph without the `If`, for calls whose rows are all greedy
            greedy = tmp / "drafter_greedy.onnx"  # fp32, only the quantizer's input
            greedy_from_cond(tmp / "drafter.onnx", greedy)
            export_drafter_ort(greedy, tmp / "drafter_ort_greedy.onnx")
            graphs["drafter_ort_greedy"] = "drafter_ort_greedy.onnx"
            for f in (greedy, greedy.with_name(greedy.name + ".data")):
                f.unlink()
            steps.update()
        steps.set_postfix_str("writing bundle")
        head = weights.get("lm_head.weight")
        shared_head = head is not None and target.model.cfg.tie_word_embeddings

        def rewrite(graph: str, model) -> None:
            if shared_head and graph.startswith("drafter"):  # the drafter gathers its embedding from the target's blocks
                embed_from_blocks(model, head)
            if weights and graph == graphs.get("target"):  # the portable graph reads the blocks too
                _, left = qdq_portable(model, traced_blocks(target.model, weights))
                if left:
                    warnings.warn(f"{left} weight matrices of the portable graph stay fp32: their blocks do not give "
                                  f"the traced numbers exactly (export/portable_qdq.py)")

        share_weights(tmp, list(graphs.values()), rewrite)
        ops = {role: graph_ops(tmp / f) for role, f in graphs.items()}
        target.tokenizer.backend_tokenizer.save(str(tmp / "tokenizer.json"))
        precision_meta = {"name": precision, **describe(weights),
                          **({"accuracy_level": ACCURACY_LEVEL} if weights else {})}
        tok = target.tokenizer
        manifest = Manifest(
            name=name or out.name,
            target=target.model.cfg,
            drafter=drafter.cfg,
            graphs=graphs,
            tokenizer="tokenizer.json",
            chat_template=tok.chat_template,
            special_tokens={"bos_token": tok.bos_token, "eos_token": tok.eos_token,
                            "stop_token_ids": list(target.stop_token_ids),
                            "mask_token_id": drafter.cfg.mask_token_id},
            dtype="float32",
            drafter_label=label,
            source_hashes={"target": sha256(target.source),
                           "drafter": sha256(drafter_source) if drafter_source else "untrained"},
            extra={"ops": ops, "precision": precision_meta, "weights": WEIGHTS_FILE,
                   **({"draft_vocab": {"size": len(vocab), "chosen": vocab_note}} if vocab is not None else {})},
        )
        manifest.files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        manifest.save(tmp)  # the tables below are not its files: profile and calibrate rewrite them
        steps.update()
        _ship_calibration(drafter_source, tmp, manifest, out)
        if quick_profile:
            steps.set_postfix_str("profiling this machine (dspark profile, quick)")
            profile(tmp, QUICK)
        _replace(tmp, out)
        steps.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        steps.close()
    return manifest


def _ship_calibration(drafter_source: Path | None, tmp: Path, manifest: Manifest, out: Path) -> None:
    """The drafter checkpoint's calibration into the bundle, when it was fitted on this pair."""
    shipped = drafter_source / CALIBRATION_FILE if drafter_source is not None and drafter_source.is_dir() else None
    if shipped is None or not shipped.exists():
        return
    _, pair = Calibration.read(shipped, "fix or remove it, then export again")
    if pair != binding(manifest):
        differ = ", ".join(k for k in pair if pair[k] != binding(manifest)[k])
        warnings.warn(f"{shipped} was fitted on another {differ} than this bundle's; the bundle has no "
                      f"calibration: run `dspark calibrate --bundle {out}`", stacklevel=3)
        return
    shutil.copyfile(shipped, tmp / CALIBRATION_FILE)


def _copy_graph(src: Path, dst: Path) -> None:
    """A graph of another bundle, with its weights, as a graph of its own (share_weights then
    stores them with the rest)."""
    model = onnx.load(str(src), load_external_data=True)
    onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.name + ".data", size_threshold=1024)


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished bundle into place; an existing bundle is replaced only now."""
    os.chmod(tmp, 0o755)
    for p in tmp.iterdir():  # the ONNX external .data files come out 0600: make every file readable
        os.chmod(p, 0o644)  # by the user that serves the bundle, like the directory
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
