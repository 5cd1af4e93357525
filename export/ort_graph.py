"""The target as an ONNX Runtime-specific graph, built node by node with onnx.helper.

The portable graph (graphs.TargetGraph) uses standard ONNX ops only, so TensorRT can
parse it; on ONNX Runtime's CPU provider its many small nodes are slow, so the ORT backend
runs this variant instead: per layer one fused RMSNorm+residual
(`SkipSimplifiedLayerNormalization`), one q/k/v projection and one
`GroupQueryAttention` that applies RoPE and writes the new K/V rows in place into the
static cache buffer it is given (past and present bound to the same memory).
Quantized weights (precision.py: `--precision gguf/int8/int4`) become `MatMulNBits` with int8
activations (`block_matmul`). It is the one deliberate second lowering of `TargetModel.forward`: the torch exporter
cannot emit these contrib ops, so it is written here, and the parity tests
(tests/test_ort_runtime.py, tests/test_default_bundle.py) pin it to the reference.

inputs:  input_ids [B, S] int64, logit_index [B, K] int64, seqlens_k [B] int32 (the last
         position written, = P + S - 1), total_len [] int32 (= P + S),
         past_key_i / past_value_i [B, Hkv, S_max, D]
outputs: logits [B, K, V], features [B, S, m*d], present_key_i / present_value_i
         (the same buffers as past_*, bound by the runtime); names from graph_io"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from dspark.runtime.graph_io import PAST, TARGET_ORT_INPUTS, kv_names, target_ort_outputs

from .layers import rope_cos_sin
from .onnx_export import graph_ops
from .quant import BlockWeight, concat_n
from .target import TargetModel
from .tensorrt_ops import walk_nodes

MS = "com.microsoft"
# int8 activations, quantized per row and per block of K: the only fast MatMulNBits on the CPU
# (accuracy levels 0 and 1 are slower than fp32), and rows stay apart (docs/quantization.md)
ACCURACY_LEVEL = 4


def supports_ort_graph(cfg) -> bool:
    """ONNX Runtime's CPU GroupQueryAttention needs a head size that is a multiple of 16."""
    return cfg.head_dim % 16 == 0


class Builder:
    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def weight(self, name: str, t: torch.Tensor | np.ndarray) -> str:
        arr = t.detach().float().numpy() if isinstance(t, torch.Tensor) else t
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), f"w.{name}"))
        return f"w.{name}"

    def op(self, op_type: str, inputs: list[str], outputs: list[str] | str, domain: str = "", **attrs) -> str:
        outs = [outputs] if isinstance(outputs, str) else outputs
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"{op_type}_{len(self.nodes)}",
                                           domain=domain, **attrs))
        return outs[0]


def block_matmul(g: Builder, x: str, w: BlockWeight, name: str, rank: int,
                 accuracy_level: int = ACCURACY_LEVEL) -> str:
    """x [..., K] (`rank` axes) · W [K, N] (quant.py): symmetric `MatMulNBits` (no zero points:
    onnxruntime #29853), plus x's per-block sums · offsets [K/block, N] when W has offsets (GGUF
    Q4_1's minimum, kept exactly)."""
    K, N = w.shape
    y = g.op("MatMulNBits", [x, g.weight(f"{name}.q", w.q), g.weight(f"{name}.scales", w.scales)],
             name if w.offsets is None else f"{name}_sym", domain=MS, K=K, N=N, bits=w.bits, block_size=w.block,
             accuracy_level=accuracy_level)
    if w.offsets is None:
        return y
    blocks = g.op("Reshape", [x, g.weight(f"{name}.blocks", np.array([0] * (rank - 1) + [-1, w.block], np.int64))],
                  f"{name}_blocks")  # [..., K/block, block]
    sums = g.op("ReduceSum", [blocks, g.weight(f"{name}.axis", np.array([-1], np.int64))], f"{name}_sums",
                keepdims=0)  # [..., K/block]
    return g.op("Add", [y, g.op("MatMul", [sums, g.weight(f"{name}.offsets", w.offsets)], f"{name}_min")], name)


def _linear(g: Builder, x: str, name: str, model: TargetModel, params: list[str],
            weights: dict[str, BlockWeight], rank: int = 3) -> str:
    """x · W for W = the named nn.Linear weights ([out, in]) side by side along N: quantized
    when `weights` holds them, else one fp32 MatMul."""
    if params[0] in weights:
        return block_matmul(g, x, concat_n([weights[p] for p in params]), name, rank)
    w = torch.cat([model.get_parameter(p) for p in params]).T  # [in, Σ out]
    return g.op("MatMul", [x, g.weight(name, w)], name)


def build_target_ort(model: TargetModel, feature_layer_ids: tuple[int, ...],
                     weights: dict[str, BlockWeight] | None = None) -> onnx.ModelProto:
    """weights: the quantized linear weights by parameter name (precision.py); the others, and
    the embedding, are the model's own (fp32)."""
    weights = weights or {}
    c = model.cfg
    L, H, Hkv, D, eps = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    ids_in, index_in, seqlens_in, total_in = TARGET_ORT_INPUTS
    past, (logits_out, features_out, *present) = kv_names(PAST, L), target_ort_outputs(L)
    g = Builder()
    embed = g.weight("embed_tokens", model.embed_tokens.weight)
    cos, sin = rope_cos_sin(torch.arange(c.max_position_embeddings)[None], D, c.rope_theta)  # [1, max_pos, 1, D]
    cos, sin = g.weight("cos_cache", cos[0, :, 0, :D // 2]), g.weight("sin_cache", sin[0, :, 0, :D // 2])
    if c.qk_norm:
        shape_q = g.weight("shape_heads_q", np.array([0, 0, H, D], np.int64))
        shape_k = g.weight("shape_heads_k", np.array([0, 0, Hkv, D], np.int64))
        shape_flat = g.weight("shape_flat", np.array([0, 0, -1], np.int64))
        splits_qkv = g.weight("splits_qkv", np.array([H * D, Hkv * D, Hkv * D], np.int64))

    resid = g.op("Gather", [embed, ids_in], "resid_0")  # [B, S, d]
    feats = [resid] if -1 in feature_layer_ids else []
    h = g.op("SimplifiedLayerNormalization", [resid, g.weight("norm_in_0", model.layers[0].input_layernorm.weight)],
             "h_0", axis=-1, epsilon=eps)
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        qkv = _linear(g, h, f"qkv_{i}", model, [f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"],
                      weights)  # [B, S, (H+2Hkv)D]
        if c.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE
            g.op("Split", [qkv, splits_qkv], [f"q_{i}", f"k_{i}", f"v_{i}"], axis=-1)
            q, k, v = f"q_{i}", f"k_{i}", f"v_{i}"
            q = g.op("Reshape", [q, shape_q], f"qh_{i}")
            k = g.op("Reshape", [k, shape_k], f"kh_{i}")
            q = g.op("SimplifiedLayerNormalization", [q, g.weight(f"q_norm_{i}", a.q_norm.weight)], f"qn_{i}",
                     axis=-1, epsilon=eps)
            k = g.op("SimplifiedLayerNormalization", [k, g.weight(f"k_norm_{i}", a.k_norm.weight)], f"kn_{i}",
                     axis=-1, epsilon=eps)
            attn_in = [g.op("Reshape", [q, shape_flat], f"qf_{i}"), g.op("Reshape", [k, shape_flat], f"kf_{i}"), v]
        else:
            attn_in = [qkv, "", ""]  # packed q/k/v
        o = g.op("GroupQueryAttention",
                 [*attn_in, past[i], past[L + i], seqlens_in, total_in, cos, sin],
                 [f"attn_{i}", present[i], present[L + i]], domain=MS,
                 num_heads=H, kv_num_heads=Hkv, do_rotary=1, rotary_interleaved=0)
        o = _linear(g, o, f"o_{i}", model, [f"layers.{i}.self_attn.o_proj.weight"], weights)
        h = g.op("SkipSimplifiedLayerNormalization",
                 [o, resid, g.weight(f"norm_post_{i}", layer.post_attention_layernorm.weight)],
                 [f"hp_{i}", "", "", f"resid_attn_{i}"], domain=MS, epsilon=eps)
        resid = f"resid_attn_{i}"  # residual stream after attention
        gu = _linear(g, h, f"gu_{i}", model, [f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up")],
                     weights)  # [B, S, 2I]
        g.op("Split", [gu], [f"gate_{i}", f"up_{i}"], axis=-1, num_outputs=2)
        gate, up = f"gate_{i}", f"up_{i}"
        act = g.op("QuickGelu", [gate], f"silu_{i}", domain=MS, alpha=1.0)  # x·sigmoid(x)
        m = _linear(g, g.op("Mul", [act, up], f"act_{i}"), f"mlp_{i}", model, [f"layers.{i}.mlp.down_proj.weight"],
                    weights)
        next_norm = model.layers[i + 1].input_layernorm.weight if i + 1 < L else model.norm.weight
        h = g.op("SkipSimplifiedLayerNormalization", [m, resid, g.weight(f"norm_next_{i}", next_norm)],
                 [f"h_{i + 1}", "", "", f"resid_{i + 1}"], domain=MS, epsilon=eps)
        resid = f"resid_{i + 1}"  # the output of layer i
        if i in feature_layer_ids:
            feats.append(resid)
    features = g.op("Concat", feats, features_out, axis=-1) if feats else g.op("Identity", [resid], features_out)
    d = c.hidden_size
    idx = g.op("Unsqueeze", [index_in, g.weight("axis_last", np.array([-1], np.int64))], "idx3")
    idx = g.op("Expand", [idx, g.op("Concat", [g.op("Shape", [index_in], "idx_shape"),
                                               g.weight("hidden", np.array([d], np.int64))], "idx_full", axis=0)],
               "idx_exp")
    rows = g.op("GatherElements", [h, idx], "rows", axis=1)  # [B, K, d]
    flat = g.op("Reshape", [rows, g.weight("shape_rows", np.array([-1, d], np.int64))], "rows_flat")
    if "lm_head.weight" in weights:
        logits = block_matmul(g, flat, weights["lm_head.weight"], "logits_flat", rank=2)  # [B*K, V]
    else:
        lm = embed if c.tie_word_embeddings else g.weight("lm_head", model.lm_head.weight)
        logits = g.op("Gemm", [flat, lm], "logits_flat", transB=1)  # [B*K, V]; the tied embedding, not a copy
    out_shape = g.op("Concat", [g.op("Shape", [index_in], "k_shape"),
                                g.weight("vocab", np.array([c.vocab_size], np.int64))], "logits_shape", axis=0)
    g.op("Reshape", [logits, out_shape], logits_out)

    inputs = [helper.make_tensor_value_info(ids_in, TP.INT64, ["batch", "query"]),
              helper.make_tensor_value_info(index_in, TP.INT64, ["batch", "rows"]),
              helper.make_tensor_value_info(seqlens_in, TP.INT32, ["batch"]),
              helper.make_tensor_value_info(total_in, TP.INT32, []),
              *[helper.make_tensor_value_info(n, TP.FLOAT, ["batch", Hkv, "max_seq", D]) for n in past]]
    outputs = [helper.make_tensor_value_info(logits_out, TP.FLOAT, ["batch", "rows", c.vocab_size]),
               helper.make_tensor_value_info(features_out, TP.FLOAT, ["batch", "query", None]),
               *[helper.make_tensor_value_info(n, TP.FLOAT, ["batch", Hkv, "max_seq", D]) for n in present]]
    graph = helper.make_graph(g.nodes, "dspark_target_ort", inputs, outputs, g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)],
                             producer_name="dspark-trt")


def export_target_ort(model: TargetModel, feature_layer_ids: tuple[int, ...], path: Path,
                      weights: dict[str, BlockWeight] | None = None) -> list[str]:
    with torch.no_grad():
        proto = build_target_ort(model, tuple(feature_layer_ids), weights)
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    # onnx.checker knows no contrib ops (SimplifiedLayerNormalization is registered by ONNX
    # Runtime itself), so this graph is validated by opening an ONNX Runtime session instead.
    return graph_ops(path)


def export_drafter_ort(portable: Path, path: Path) -> list[str]:
    """The drafter graph with every constant-weight MatMul/Gemm dynamically quantized to int8
    (ONNX Runtime's `quantize_dynamic`: int8 weights per tensor, uint8 activations scaled per
    call; VNNI kernels on x86). The drafter's LM head and Markov head are memory-bound GEMVs,
    which int8 weights speed up on a CPU. The sequential stage's matmuls sit inside the `If`
    of its greedy/sampled branches and are quantized too (`EnableSubgraph`): each of its γ
    Markov GEMVs reads the [V, r] matrix. Only the proposal distribution changes, and
    acceptance corrects for any proposal (dspark.md §1): losslessness does not depend on it.

    The quantizer drops node metadata; it is copied back by node name, so that profiles can
    still attribute each node to its module (the sequential stage's nodes in particular)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(portable), str(path), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"],
                     use_external_data_format=True,
                     extra_options={"MatMulConstBOnly": True, "EnableSubgraph": True})
    meta = {n.name: n.metadata_props for n in walk_nodes(onnx.load(str(portable), load_external_data=False).graph)}
    model = onnx.load(str(path), load_external_data=False)
    for node in walk_nodes(model.graph):
        if not node.metadata_props and node.name in meta:
            node.metadata_props.extend(meta[node.name])
    onnx.save_model(model, str(path))  # the graph only: its external weights file stays as written
    return graph_ops(path)

