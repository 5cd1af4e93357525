"""Quantized targets (`dspark export --precision`): the block layout, GGUF repacking, the ONNX
Runtime lowering, and a quantized bundle served.

A quantized target runs with int8 activations, so it is its own target: greedy speculative
output equals the same graph decoding alone, token for token, because the graph scores every row
with the bits it gets alone (docs/quantization.md). Against the torch reference (fp32 arithmetic
on the same dequantized weights) it agrees within the activation rounding."""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from factories import TINY_CALIBRATION, TINY_SPS, assert_rows_invariant, assert_symmetric_matmulnbits, tiny_target
from gguf import GGMLQuantizationType, quants

from dspark.export import TorchBackend
from dspark.export.ort_graph import MS, Builder, block_matmul
from dspark.export.precision import dequantize_into, describe, target_weights
from dspark.export.quant import BlockWeight, concat_n, from_q4_1, from_q8_0, quantize_rtn, split_blocks, take_n
from dspark.runtime import Engine
from dspark.runtime.backends.onnxruntime import session_options
from dspark.runtime.errors import BackendError, CheckpointError
from dspark.runtime.manifest import Manifest

PROMPTS = ["Hello there, how are you?", "What is 17 * 23?", "aaaa bbbb aaaa bbbb"]


# --- the block layout ------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype, repack", [(GGMLQuantizationType.Q4_1, from_q4_1),
                                            (GGMLQuantizationType.Q8_0, from_q8_0)])
def test_gguf_blocks_repack_to_ggml_numbers(qtype, repack):
    """The repacked weight stands for what ggml's own dequantization gives (the gguf package's
    reference quantizer and dequantizer on a small [N, K] tensor)."""
    w = np.random.default_rng(0).normal(0, 1, (6, 96)).astype(np.float32)  # [N, K]
    raw = quants.quantize(w, qtype)
    ggml = quants.dequantize(raw, qtype)  # [N, K]
    got = repack(raw, 96)
    assert got.shape == (96, 6)
    np.testing.assert_allclose(got.dequantize(), ggml.T, rtol=0, atol=1e-6 * np.abs(ggml).max())
    assert (got.offsets is not None) == (qtype == GGMLQuantizationType.Q4_1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k, block", [(64, 32), (136, 64)])  # 136: the last block zero-padded
def test_rtn_is_within_half_a_step(bits, k, block):
    w = np.random.default_rng(1).normal(0, 1, (k, 5)).astype(np.float32)
    q = quantize_rtn(w, bits, block)
    assert q.shape == (k, 5) and q.q.shape == (5, -(-k // block), block * bits // 8)
    step = np.repeat(q.scales.T, block, axis=0)[:k]  # [K, N]
    assert np.all(np.abs(q.dequantize() - w) <= step / 2 + 1e-6)


def test_fusing_and_reordering_columns_keep_the_numbers():
    rng = np.random.default_rng(2)
    a, b = (from_q4_1(quants.quantize(rng.normal(0, 1, (n, 64)).astype(np.float32), GGMLQuantizationType.Q4_1), 64)
            for n in (3, 5))
    both = concat_n([a, b])
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([a.dequantize(), b.dequantize()], axis=1))
    order = np.array([4, 0, 7, 1, 2, 3, 5, 6])
    np.testing.assert_array_equal(take_n(both, order).dequantize(), both.dequantize()[:, order])


def test_splitting_blocks_keeps_every_weight():
    """GGUF's Q4_1 in blocks of 16 (scripts/quant_kernels.py's candidate) is the same matrix."""
    w = np.random.default_rng(3).normal(0, 1, (5, 96)).astype(np.float32)  # [N, K]
    q = from_q4_1(quants.quantize(w, GGMLQuantizationType.Q4_1), 96)
    half = split_blocks(q, 16)
    assert half.block == 16 and half.q.shape == (5, 6, 8) and half.offsets.shape == (6, 5)
    np.testing.assert_array_equal(half.dequantize(), q.dequantize())
    with pytest.raises(ValueError):
        split_blocks(q, 12)


# --- the ONNX Runtime lowering ---------------------------------------------------------------------

def block_session(w: BlockWeight, accuracy_level: int | None = None) -> ort.InferenceSession:
    from onnx import TensorProto as TP
    from onnx import helper

    g = Builder()
    block_matmul(g, "x", w, "y", accuracy_level)
    K, N = w.shape
    graph = helper.make_graph(g.nodes, "one", [helper.make_tensor_value_info("x", TP.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, ["M", N])], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    return ort.InferenceSession(model.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("form", ["q4_1", "q8_0", "rtn4"])
def test_block_matmul_computes_the_weight_and_keeps_rows_apart(form):
    """x·W within int8 activation rounding; a row's output does not depend on the other rows of
    the call (up to the M = 1 and M > 1 kernels' rounding)."""
    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, (40, 128)).astype(np.float32)  # [N, K]
    bw = {"q4_1": lambda: from_q4_1(quants.quantize(w, GGMLQuantizationType.Q4_1), 128),
          "q8_0": lambda: from_q8_0(quants.quantize(w, GGMLQuantizationType.Q8_0), 128),
          "rtn4": lambda: quantize_rtn(w.T, 4, 64)}[form]()
    s = block_session(bw)
    x = rng.normal(0, 1, (8, 128)).astype(np.float32)
    ref = x @ bw.dequantize()
    y = s.run(None, {"x": x})[0]
    assert np.abs(y - ref).max() <= 0.02 * np.abs(ref).max()
    solo = s.run(None, {"x": x[:1]})[0]
    crowded = s.run(None, {"x": np.concatenate([x[:1], 100 * x[1:]])})[0][:1]
    np.testing.assert_allclose(crowded, solo, rtol=1e-5, atol=1e-5 * np.abs(solo).max())


@pytest.mark.parametrize("form", ["q4_1", "q8_0", "rtn4_odd_k"])
def test_the_portable_qdq_form_runs_the_kernel_of_matmulnbits_bit_for_bit(form):
    """block_matmul writes DequantizeLinear (signed int4/int8, blocked along K) → MatMul, which
    TensorRT reads; ONNX Runtime's sessions fuse it into the symmetric MatMulNBits, so it gives
    the bits of MatMulNBits written directly at ACCURACY_LEVEL, at every M."""
    from dspark.export.ort_graph import ACCURACY_LEVEL

    rng = np.random.default_rng(5)
    K = 96 if form == "rtn4_odd_k" else 128  # 96 = 1.5 blocks of 64: a padded last block
    w = rng.normal(0, 1, (48, K)).astype(np.float32)  # [N, K]
    bw = {"q4_1": lambda: from_q4_1(quants.quantize(w, GGMLQuantizationType.Q4_1), K),
          "q8_0": lambda: from_q8_0(quants.quantize(w, GGMLQuantizationType.Q8_0), K),
          "rtn4_odd_k": lambda: quantize_rtn(w.T, 4, 64)}[form]()
    qdq, direct = block_session(bw), block_session(bw, ACCURACY_LEVEL)
    for M in (1, 2, 5, 16):
        x = rng.normal(0, 1, (M, K)).astype(np.float32)
        np.testing.assert_array_equal(qdq.run(None, {"x": x})[0], direct.run(None, {"x": x})[0])


def test_the_quantized_linears_pass_the_tensorrt_operator_check(tmp_path):
    """block_matmul's graph (GGUF Q4_1 with its minimum term, Q8_0, RTN int4) holds only what
    TensorRT 11's parser reads (export/tensorrt_ops.py: DequantizeLinear with a zero zero point,
    constant scales, blocks along K): a static check, never a TensorRT build."""
    from onnx import TensorProto as TP
    from onnx import helper

    from dspark.export.tensorrt_ops import check_graph

    rng = np.random.default_rng(7)
    w = rng.normal(0, 1, (48, 128)).astype(np.float32)  # [N, K]
    g = Builder()
    for name, bw in (("q4_1", from_q4_1(quants.quantize(w, GGMLQuantizationType.Q4_1), 128)),
                     ("q8_0", from_q8_0(quants.quantize(w, GGMLQuantizationType.Q8_0), 128)),
                     ("rtn4", quantize_rtn(w.T, 4, 64))):
        block_matmul(g, "x", bw, name)
    graph = helper.make_graph(g.nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["M", 128])],
                              [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("q4_1", "q8_0", "rtn4")],
                              g.inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(tmp_path / "g.onnx"))
    assert check_graph(tmp_path / "g.onnx") == []


def test_a_tied_embedding_gathers_the_heads_bytes_bit_for_bit():
    """block_gather reads the LM head's int8 codes (a copy by name, so the head's DequantizeLinear
    still fuses) and dequantizes each row as BlockWeight.dequantize does: the same bits."""
    from onnx import TensorProto as TP
    from onnx import helper

    from dspark.export.ort_graph import block_gather

    rng = np.random.default_rng(6)
    w = rng.normal(0, 1, (50, 128)).astype(np.float32)  # [V, d]: the tied table
    head = from_q8_0(quants.quantize(w, GGMLQuantizationType.Q8_0), 128)  # W [d, V]
    g = Builder()
    block_gather(g, "ids", head, "logits_flat", "rows")
    block_matmul(g, "x", head, "logits")
    graph = helper.make_graph(g.nodes, "g", [helper.make_tensor_value_info("ids", TP.INT64, ["B", "S"]),
                                             helper.make_tensor_value_info("x", TP.FLOAT, ["M", 128])],
                              [helper.make_tensor_value_info("rows", TP.FLOAT, None),
                               helper.make_tensor_value_info("logits", TP.FLOAT, None)], g.inits)
    path = Path(tempfile.mkdtemp()) / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    assert assert_symmetric_matmulnbits(path) == 1  # the head fused although its bytes are gathered too
    s = ort.InferenceSession(str(path), session_options(1), providers=["CPUExecutionProvider"])
    ids = np.array([[3, 0, 49], [7, 7, 1]])
    rows = s.run(["rows"], {"ids": ids, "x": np.zeros((1, 128), np.float32)})[0]
    np.testing.assert_array_equal(rows, head.dequantize().T[ids])


# --- precisions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision, layer_bits", [("int8", 8), ("int4", 4)])
def test_rtn_precisions_quantize_every_linear_and_the_head(precision, layer_bits, tmp_path):
    model = tiny_target("llama", seed=5)
    weights = target_weights(model, tmp_path, precision)
    assert len(weights) == 7 * model.cfg.num_layers + 1
    assert weights["lm_head.weight"].bits == 8
    assert {w.bits for n, w in weights.items() if n != "lm_head.weight"} == {layer_bits}
    assert describe(weights)["lm_head"] == "8-bit b64"
    dequantize_into(model, weights)
    np.testing.assert_array_equal(model.layers[1].mlp.down_proj.weight.detach().numpy(),
                                  weights["layers.1.mlp.down_proj.weight"].dequantize().T)


def test_precision_refusals(tmp_path):
    model = tiny_target("llama", seed=5)
    with pytest.raises(CheckpointError, match="already quantized.*--precision gguf"):
        target_weights(model, tmp_path / "model.gguf", "int4")
    with pytest.raises(CheckpointError, match="needs a .gguf source"):
        target_weights(model, tmp_path, "gguf")
    with pytest.raises(CheckpointError, match="unknown precision 'int3'"):
        target_weights(model, tmp_path, "int3")


def test_an_unhandled_gguf_type_is_named_with_its_tensors(tmp_path):
    """A GGUF whose q projection is Q5_0: the error names the type and the tensor."""
    from gguf import GGUFWriter

    model = tiny_target("llama", seed=5, layers=1)
    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "llama")
    params = dict(model.named_parameters())
    for gname, name, qtype in [("blk.0.attn_q.weight", "layers.0.self_attn.q_proj.weight", GGMLQuantizationType.Q5_0),
                               ("blk.0.attn_k.weight", "layers.0.self_attn.k_proj.weight", GGMLQuantizationType.Q4_1),
                               ("token_embd.weight", "embed_tokens.weight", GGMLQuantizationType.Q8_0),
                               ("output.weight", "lm_head.weight", GGMLQuantizationType.Q6_K)]:
        w = params[name].detach().numpy()
        if qtype == GGMLQuantizationType.Q6_K:  # one 256-wide super-block per row: any bytes will do
            raw = np.zeros((w.shape[0], 210), np.uint8)
        else:
            raw = quants.quantize(w, qtype)
        writer.add_tensor(gname, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"Q5_0: blk\.0\.attn_q\.weight; Q6_K: output\.weight") as e:
        target_weights(model, path, "gguf")
    assert "attn_k" not in str(e.value)


# --- a quantized bundle ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def int4_bundle(tiny_bundle, tmp_path_factory):
    """The tiny bundle's target and drafter exported at int4, with a synthetic SPS table and
    calibration (for the schedulers that need them)."""
    from dspark.export.bundle import export_bundle

    out = tmp_path_factory.mktemp("int4") / "bundle"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_bundle(out, tiny_bundle.target_dir, tiny_bundle.drafter_dir, progress=False, quick_profile=False, precision="int4")
    TINY_SPS.save(out, {"synthetic": True, "precision": "int4"})
    TINY_CALIBRATION.save(out, {"synthetic": True})
    return out


@pytest.fixture(scope="module")
def int4_engine(int4_bundle):
    return Engine.load(int4_bundle, max_seq=256, threads=1)


def test_manifest_records_the_precision(int4_bundle):
    m = Manifest.load(int4_bundle)
    assert m.precision == "int4"
    assert m.extra["precision"] == {"name": "int4", "layers": "4-bit b64", "lm_head": "8-bit b64", "accuracy_level": 4}
    assert "ai.onnx::DequantizeLinear" in m.extra["ops"]["target_ort"]  # the portable form, fused when run:
    assert assert_symmetric_matmulnbits(int4_bundle / "target_ort.onnx") == 4 * m.target.num_layers + 1


@pytest.mark.parametrize("scheduler", ["none", "fixed", "cost"])
def test_quantized_decoding_repeats_itself(int4_engine, scheduler):
    """The same requests through the same quantized graph give the same tokens: rejected rows are
    dropped by moving a length, and nothing of one generation leaks into the next."""
    for prompt in PROMPTS:
        first = int4_engine.generate(prompt, max_new_tokens=40, scheduler=scheduler)
        again = int4_engine.generate(prompt, max_new_tokens=40, scheduler=scheduler)
        assert again.token_ids == first.token_ids, f"{prompt!r} ({scheduler})"


def test_quantized_target_rows_are_invariant_to_the_call(int4_bundle):
    """What makes a quantized target lossless: its int8 activation rounding sees the same bits
    in a verification row as in the decode step it stands for (and in a batch as alone)."""
    assert_rows_invariant(Engine.load(int4_bundle, max_seq=256, slots=2), PROMPTS)


@pytest.mark.parametrize("scheduler", ["fixed", "threshold", "prefix", "async", "cost"])
def test_greedy_output_equals_the_quantized_graph_alone(int4_engine, scheduler):
    """Lossless on a quantized target: the same graph, with and without speculation, token for
    token (the graph scores a row with the same bits whatever the call: test_ort_runtime.py)."""
    for prompt in PROMPTS:
        alone = int4_engine.generate(prompt, max_new_tokens=40, scheduler="none")
        spec = int4_engine.generate(prompt, max_new_tokens=40, scheduler=scheduler)
        assert spec.token_ids == alone.token_ids, f"{prompt!r} ({scheduler})"


def test_quantized_graph_is_near_its_torch_reference(tiny_bundle, int4_bundle, int4_engine):
    """The torch reference holds the same dequantized weights; the graph's int8 activations
    keep its logits within a few percent of the reference's."""
    from dspark.export import load_target

    target = load_target(tiny_bundle.target_dir).model
    dequantize_into(target, target_weights(target, tiny_bundle.target_dir, "int4"))
    ids = np.asarray(int4_engine.encode(PROMPTS[0]), np.int64)
    got, _ = int4_engine.backend.target(ids[None], np.zeros(1, np.int64))
    ref, _ = TorchBackend(target, None, 128).target(ids[None], np.zeros(1, np.int64))
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_quantized_bundle_refuses_what_would_run_another_arithmetic(int4_bundle, tiny_bundle, tmp_path):
    with pytest.raises(BackendError, match="int4 target"):
        Engine.load(int4_bundle, max_seq=128, target_graph="portable")
    from dspark.export.bundle import export_bundle

    with pytest.raises(CheckpointError, match="its target graphs are fp32, not --precision int4"):
        export_bundle(tmp_path / "b", tiny_bundle.target_dir, tiny_bundle.drafter_dir, progress=False, quick_profile=False,
                      reuse_target=tiny_bundle.path, precision="int4")
    assert not (tmp_path / "b").exists()


def _portable_feeds(session: ort.InferenceSession, rng: np.random.Generator, vocab: int) -> dict[str, np.ndarray]:
    """Inputs of the portable target graph: 2 requests of 5 tokens after 3 cached positions."""
    B, S, P = 2, 5, 3
    sizes = {"batch": B, "query": S, "rows": 2, "past": P, "max_seq": 16}
    feeds = {"input_ids": rng.integers(0, vocab, (B, S)), "positions": np.tile(np.arange(P, P + S), (B, 1)),
             "logit_index": np.tile(np.array([0, S - 1]), (B, 1)), "past_mask": np.zeros((B, P), np.float32)}
    for i in session.get_inputs():
        if i.name not in feeds:  # the cache
            feeds[i.name] = rng.standard_normal([sizes.get(d, d) for d in i.shape]).astype(np.float32)
    return feeds


def test_the_portable_graph_of_a_quantized_bundle_reads_the_blocks(tiny_bundle, int4_bundle, int4_portable_bundle,
                                                                    tmp_path):
    """`--portable` on an int4 bundle: the traced target.onnx holds DequantizeLinear of the blocks
    (4 per layer, the head and the tied embedding's rows) instead of fp32 matrices, passes the
    TensorRT 11 operator check, shares the blocks the ONNX Runtime graph also reads (weights.bin
    grows by the codes only the trace's fused q·scale/k/v and o hold), and computes what the trace
    of the dequantized model computes, within int8 activation rounding."""
    from dspark.export import load_target
    from dspark.export.onnx_export import export_target
    from dspark.export.tensorrt_ops import check_graph

    portable, messages = int4_portable_bundle
    assert not [m for m in messages if "stay fp32" in m]
    path = portable / "target.onnx"
    graph = onnx.load(str(path), load_external_data=False).graph
    target = load_target(tiny_bundle.target_dir).model
    c = target.cfg
    tied = c.tie_word_embeddings  # an untied embedding table stays fp32, as in the ONNX Runtime graph
    assert sum(n.op_type == "DequantizeLinear" for n in graph.node) == 4 * c.num_layers + 1 + tied
    matrices = [tuple(t.dims) for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT
                and len(t.dims) == 2 and min(t.dims) >= c.hidden_size]
    assert matrices == ([] if tied else [(c.vocab_size, c.hidden_size)])  # no fp32 weight matrix left
    assert check_graph(path) == []
    with_portable, without = ((b / "weights.bin").stat().st_size for b in (portable, int4_bundle))
    assert without < with_portable < 1.1 * without

    dequantize_into(target, target_weights(target, tiny_bundle.target_dir, "int4"))
    with torch.inference_mode(False), torch.no_grad():
        export_target(target, Manifest.load(int4_bundle).drafter.target_layer_ids, tmp_path / "fp32.onnx")
    qdq, fp32 = (ort.InferenceSession(str(p), session_options(1), providers=["CPUExecutionProvider"])
                 for p in (path, tmp_path / "fp32.onnx"))
    feeds = _portable_feeds(fp32, np.random.default_rng(0), target.cfg.vocab_size)
    for a, b in zip(qdq.run(None, feeds)[:2], fp32.run(None, feeds)[:2]):  # logits, features
        assert np.abs(a - b).max() <= 0.05 * np.abs(b).max()


def test_int8_target_graph_matches_the_engine_alone(tiny_bundle):
    """int8 at graph level (no second bundle): the lowering of every linear weight and the head."""
    from dspark.export import load_target
    from dspark.export.ort_graph import build_target_ort

    target = load_target(tiny_bundle.target_dir).model
    weights = target_weights(target, tiny_bundle.target_dir, "int8")
    dequantize_into(target, weights)
    with torch.no_grad():
        proto = build_target_ort(target, (), weights)
    ops = {n.op_type for n in proto.graph.node}
    assert "DequantizeLinear" in ops and "Gemm" not in ops
    assert sum(n.op_type == "DequantizeLinear" for n in proto.graph.node) == 4 * target.cfg.num_layers + 1


def test_validate_compares_a_quantized_bundle_with_its_reference(int4_bundle, tiny_bundle, capsys, one_torch_thread):
    """`dspark validate --backend torch` on an int4 bundle: the torch reference (the same weights,
    fp32 arithmetic) passes within the quantized bounds; the same comparison catches a candidate
    whose target distribution is wrong (its logits reversed)."""
    import json

    from dspark.runtime.tools.cli import main
    from dspark.runtime.tools.validate import QuantizedBound, open_any_backend, validate

    rc = main(["validate", "--bundle", str(int4_bundle), "--backend", "torch", "--json", "--max-new-tokens", "24",
               "--target", str(tiny_bundle.target_dir), "--drafter", str(tiny_bundle.drafter_dir)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"], report
    assert report["quantized"] == {"mean_kl": 0.05, "feature_rel": 0.1}
    methods = {c["name"].split(" (")[0]: c["method"] for c in report["comparisons"]}
    assert methods["prefill logits"] == "distribution" and methods["verify features"] == "relative"
    assert methods["draft probs"] in ("numpy", "polygraphy")  # the drafter stays fp32 on both sides

    class Reversed:  # the reference's target with its logits negated: another distribution
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def target(self, tokens, starts):
            logits, feats = self.inner.target(tokens, starts)
            return -logits, feats

    m = Manifest.load(int4_bundle)
    ref = open_any_backend("onnxruntime", int4_bundle, m, 256)
    bad = Reversed(open_any_backend("onnxruntime", int4_bundle, m, 256))
    v = validate(ref, bad, [[5, 6, 7, 8, 9]], ("onnxruntime", "reversed"), max_new_tokens=4, quantized=QuantizedBound())
    failed = {c.name.split(" (")[0] for c in v.comparisons if not c.ok}
    assert {"prefill logits", "verify logits"} <= failed and not v.ok
