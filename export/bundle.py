"""`dspark export`: target + drafter -> a bundle directory of ONNX graphs, tokenizer and
manifest. Written into a temporary directory and renamed at the end, so an interrupted
export never leaves a half bundle."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.runtime.errors import CheckpointError
from dspark.runtime.manifest import Manifest

from .checkpoint import load_drafter
from .drafter import Drafter, init_drafter
from .onnx_export import export_drafter, export_target
from .ort_graph import export_target_ort, supports_ort_graph
from .target_loader import LoadedTarget, load_target

UNTRAINED = "untrained: random initialisation (1 layer, γ=7, vanilla Markov r=64, seed 0); no speedup expected"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def resolve_drafter(target: LoadedTarget, drafter_path: str | Path | None) -> tuple[Drafter, str]:
    """The drafter at `drafter_path` (embeddings restored from the target if left out), or
    the untrained default, labelled as such."""
    m = target.model
    if drafter_path is None:
        return init_drafter(m), UNTRAINED
    path = Path(drafter_path)
    if not path.exists():
        raise CheckpointError(f"drafter checkpoint {path} does not exist")
    drafter = load_drafter(path, embeddings=(m.embed_tokens.weight, m.lm_head.weight))
    drafter.cfg.check_against(m.cfg)
    return drafter, str(path)


def export_bundle(out: str | Path, target_path: str | Path | None = None, drafter_path: str | Path | None = None,
                  name: str | None = None, progress: bool = True) -> Manifest:
    out = Path(out)
    steps = tqdm(total=6, desc="export", disable=not progress, unit="step")
    steps.set_postfix_str("loading target")
    target = load_target(target_path)
    steps.update()
    steps.set_postfix_str("loading drafter")
    drafter, label = resolve_drafter(target, drafter_path)
    steps.update()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with torch.inference_mode(False), torch.no_grad():
            steps.set_postfix_str("exporting target graph")
            ops = {"target": export_target(target.model, drafter.cfg.target_layer_ids, tmp / "target.onnx")}
            steps.update()
            steps.set_postfix_str("exporting drafter graph")
            ops["drafter"] = export_drafter(drafter, tmp / "drafter.onnx")
            steps.update()
            graphs = {"target": "target.onnx", "drafter": "drafter.onnx"}
            if supports_ort_graph(target.model.cfg):
                steps.set_postfix_str("writing ONNX Runtime target graph")
                ops["target_ort"] = export_target_ort(target.model, drafter.cfg.target_layer_ids,
                                                      tmp / "target_ort.onnx")
                graphs["target_ort"] = "target_ort.onnx"
            steps.update()
        steps.set_postfix_str("writing bundle")
        target.tokenizer.backend_tokenizer.save(str(tmp / "tokenizer.json"))
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
                           "drafter": sha256(Path(drafter_path)) if drafter_path else "untrained"},
            extra={"ops": ops},
        )
        manifest.files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        manifest.save(tmp)
        _replace(tmp, out)
        steps.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        steps.close()
    return manifest


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
