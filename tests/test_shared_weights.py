"""Each weight once per bundle (export/shared_weights.py): every graph's tensors in one
weights.bin, each distinct tensor once; a tied embedding gathered from the LM head's blocks
(ort_graph.embed_from_blocks); bf16-exact tensors stored as bf16. The graphs must compute the
same bits as the graphs as exported, and the bundle must stay lossless."""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import external_data_helper as ext

from dspark.runtime import Engine
from dspark.runtime.errors import BundleError
from dspark.runtime.manifest import Manifest

DRAFTER_GRAPHS = ("drafter.onnx", "drafter_ort.onnx")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny target whose LM head is its embedding, a drafter checkpoint without embeddings (the
    target's are restored into it, as for the shipped drafter), and the int8 bundle of them (no
    portable graph: what `dspark export` writes by default)."""
    from factories import copy_drafter, write_tiny_hf_target

    from dspark.export import load_target, save_drafter
    from dspark.export.bundle import export_bundle

    root = tmp_path_factory.mktemp("tied")
    write_tiny_hf_target(root / "target", seed=3, tie=True)
    save_drafter(copy_drafter(load_target(root / "target").model, block_size=4, boost=4.0), root / "drafter",
                 include_embeddings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_bundle(root / "bundle", root / "target", root / "drafter", progress=False, quick_profile=False, precision="int8")
    return root


def _external(path: Path) -> list[tuple[int, int]]:
    """(offset, length) of every tensor the graph keeps in weights.bin, subgraphs included."""
    from dspark.export.tensorrt_ops import subgraphs

    model = onnx.load(str(path), load_external_data=False)
    out = []
    for g in subgraphs(model.graph):
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                info = ext.ExternalDataInfo(t)
                assert info.location == "weights.bin"
                out.append((int(info.offset), int(info.length)))
    return out


@pytest.mark.parametrize("which", ["tied", "tiny"])
def test_each_weight_is_stored_once(which, tied, tiny_bundle):
    bundle = tied / "bundle" if which == "tied" else tiny_bundle.path
    m = Manifest.load(bundle)
    assert not list(bundle.glob("*.data")) and m.extra["weights"] == "weights.bin"
    spans = {s for f in m.graphs.values() for s in _external(bundle / f)}
    data = (bundle / "weights.bin").read_bytes()
    chunks = [data[o:o + n] for o, n in sorted(spans)]
    assert len(set(chunks)) == len(chunks), "two offsets hold the same tensor"
    assert sum(n for _, n in spans) <= len(data) < sum(n for _, n in spans) + 64 * 1024 * len(spans)
    shared = set(_external(bundle / "drafter_ort.onnx")) & set(_external(bundle / "drafter_ort_greedy.onnx"))
    assert shared, "the two int8 drafter graphs share their weights"


def test_a_tied_embedding_is_gathered_from_the_head_blocks(tied):
    """No graph of the tied int8 bundle holds the [V, d] float table: the target and the drafter
    gather their rows from the LM head's 8-bit blocks, one copy for all of them."""
    m = Manifest.load(tied / "bundle")
    V, d = m.target.vocab_size, m.target.hidden_size
    for f in m.graphs.values():
        model = onnx.load(str(tied / "bundle" / f), load_external_data=False)
        from dspark.export.tensorrt_ops import subgraphs

        assert not [t.name for g in subgraphs(model.graph) for t in g.initializer if tuple(t.dims) == (V, d)], f
    head = {s for s in _external(tied / "bundle" / "target_ort.onnx")}
    assert head & set(_external(tied / "bundle" / "drafter.onnx")), "the drafter reads the target's blocks"


def _feeds(session: ort.InferenceSession, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random inputs of a drafter graph: 1 row, 3 context rows, 6 cached positions."""
    n, P, S = 3, 6, 16
    feeds = {}
    for i in session.get_inputs():
        fixed = [d for d in i.shape if isinstance(d, int)]
        shapes = {"features": (1, n, *fixed[-1:]), "anchor": (1,), "temperature": (1,), "past_mask": (1, P),
                  "ctx_mask": (1, n)}
        if i.name == "positions":
            feeds[i.name] = np.arange(P, P + n + session.get_inputs()[4].shape[1])[None].astype(np.int64)
        elif i.name == "uniforms":
            feeds[i.name] = rng.random((1, i.shape[1]), dtype=np.float32)
        elif i.name == "anchor":
            feeds[i.name] = rng.integers(0, 90, 1).astype(np.int64)
        elif i.name in shapes:
            feeds[i.name] = (rng.standard_normal(shapes[i.name]) if i.name == "features"
                             else np.zeros(shapes[i.name]) if "mask" in i.name else np.ones(shapes[i.name]))
        else:  # past KV [1, Hkv, S_max, D]
            feeds[i.name] = rng.standard_normal((1, i.shape[1], S, i.shape[3]))
        feeds[i.name] = feeds[i.name].astype(np.int64 if "int64" in i.type else np.float32)
    return feeds


def test_shared_graphs_compute_what_was_exported(tied, tmp_path):
    """The drafter graphs of the tied int8 bundle (embedding gathered from blocks, bf16 weights
    widened, weights shared) give the same bits as the graphs exported from the same drafter
    before any of that."""
    from dspark.export import load_drafter, load_target
    from dspark.export.onnx_export import export_drafter
    from dspark.export.ort_graph import export_drafter_ort
    from dspark.export.precision import dequantize_into, target_weights

    target = load_target(tied / "target").model
    dequantize_into(target, target_weights(target, tied / "target", "int8"))
    drafter = load_drafter(tied / "drafter", embeddings=(target.embed_tokens.weight, target.lm_head.weight))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_drafter(drafter, tmp_path / "drafter.onnx")
        export_drafter_ort(tmp_path / "drafter.onnx", tmp_path / "drafter_ort.onnx")
    from dspark.runtime.backends.onnxruntime import session_options

    so = session_options(1)  # the process's shared pool, as every other session of the tests
    rng = np.random.default_rng(0)
    for f in DRAFTER_GRAPHS:
        exported, shared = (ort.InferenceSession(str(d / f), so, providers=["CPUExecutionProvider"])
                            for d in (tmp_path, tied / "bundle"))
        for temperature in (0.0, 1.0):
            feeds = _feeds(exported, rng) | {"temperature": np.full(1, temperature, np.float32)}
            for a, b in zip(exported.run(None, feeds), shared.run(None, feeds)):
                assert np.array_equal(a, b), f


@pytest.mark.parametrize("scheduler", ["fixed", "prefix"])
def test_tied_int8_bundle_is_lossless(tied, scheduler):
    from factories import TINY_CALIBRATION, TINY_SPS

    bundle = tied / "bundle"
    if not (bundle / "sps.json").exists():
        TINY_SPS.save(bundle, {"synthetic": True, "precision": "int8"})
        TINY_CALIBRATION.save(bundle, {"synthetic": True})
    engine = Engine.load(bundle, max_seq=128, threads=1, slots=2)
    prompts = ["hello there", "abc abc abc"]
    spec = engine.generate_batch(prompts, max_new_tokens=24, scheduler=scheduler)
    alone = engine.generate_batch(prompts, max_new_tokens=24, scheduler="none")
    assert [r.token_ids for r in spec] == [r.token_ids for r in alone]


def test_the_portable_graph_is_written_only_when_asked(tied, tiny_bundle, tmp_path):
    """`dspark export` leaves out target.onnx unless --portable (the tiny bundle asked for it);
    what needs it says how to get it."""
    import json

    assert "target" not in Manifest.load(tied / "bundle").graphs and not (tied / "bundle" / "target.onnx").exists()
    assert Manifest.load(tiny_bundle.path).graphs["target"] == "target.onnx"
    bundle = tmp_path / "fp32"  # the fp32 tiny bundle as an export without --portable writes it
    shutil.copytree(tiny_bundle.path, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["graphs"]["target"]
    del manifest["files"]["target.onnx"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    (bundle / "target.onnx").unlink()
    Engine.load(bundle, max_seq=64)  # the CPU engine never needs it
    with pytest.raises(BundleError, match=r"no portable target graph \(target.onnx\).*dspark export --portable"):
        Engine.load(bundle, max_seq=64, target_graph="portable")
