"""The target as an ONNX Runtime-specific graph, built node by node with onnx.helper.

The portable graph (graphs.TargetGraph) uses standard ONNX ops only, so TensorRT can
parse it; on ONNX Runtime's CPU provider its many small nodes are slow, so the ORT backend
runs this variant instead: per layer one fused RMSNorm+residual
(`SkipSimplifiedLayerNormalization`), one q/k/v projection, `RotaryEmbedding`, and an
attention (`_attention`) that writes the new K/V rows in place into the static cache buffer
it is given (past and present bound to the same memory, `TensorScatter`) and reads it with
one `MultiHeadAttention`.
Quantized weights (precision.py: `--precision gguf/int8/int4`) become `MatMulNBits` with int8
activations (`block_matmul`). It is the one deliberate second lowering of `TargetModel.forward`: the torch exporter
cannot emit these contrib ops, so it is written here, and the parity tests
(tests/test_ort_runtime.py, tests/test_default_bundle.py) pin it to the reference.

Every op of this graph gives a query row the same bits whatever else the call holds: other
rows (verifying S tokens is S decode steps, bit for bit) and other slots. That is what keeps a
target with int8 activations lossless: its rounding turns 1e-7 differences into whole
quantization steps (docs/quantization.md), so "the same graph decoding alone" must hold exactly.

inputs:  input_ids [B, S] int64, logit_index [B, K] int64, starts [B] int64 (the position of
         each row's first token), key_count [1] int64 (cache positions attention reads: at
         least max(starts) + S), past_key_i / past_value_i [B, Hkv, S_max, D]
outputs: logits [B, K, V], features [B, S, m*d], present_key_i / present_value_i
         (the same buffers as past_*, bound by the runtime); names from graph_io"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from dspark.runtime.backends.onnxruntime import QDQ_ACCURACY_LEVEL
from dspark.runtime.graph_io import MASKED, PAST, TARGET_ORT_INPUTS, kv_names, target_ort_outputs

from .layers import rope_cos_sin
from .onnx_export import graph_ops
from .quant import BlockWeight, concat_n, take_k, take_n
from .target import TargetModel
from .tensorrt_ops import subgraphs, walk_nodes

MS = "com.microsoft"
# int8 activations, quantized per row and per block of K: the only fast MatMulNBits on the CPU
# (accuracy levels 0 and 1 are slower than fp32), and rows stay apart (docs/quantization.md);
# the runtime's sessions fuse the graph's DequantizeLinear → MatMul into it at this level
ACCURACY_LEVEL = QDQ_ACCURACY_LEVEL


def hidden_name(i: int) -> str:
    """The normed hidden stream [B·S, d] that layer i reads; i = L: after the final norm, the LM
    head's input (engine_states reads it)."""
    return f"h_{i}"


def supports_ort_graph(cfg) -> bool:
    """`RotaryEmbedding` rotates halves of a head: its size must be even."""
    return cfg.head_dim % 2 == 0


class Builder:
    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def weight(self, name: str, t: torch.Tensor | np.ndarray) -> str:
        arr = t.detach().float().numpy() if isinstance(t, torch.Tensor) else t
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), f"w.{name}"))
        return f"w.{name}"

    def const(self, name: str, value: np.ndarray) -> str:
        """A small constant, added once however often it is asked for."""
        if f"w.{name}" not in {t.name for t in self.inits}:
            return self.weight(name, value)
        return f"w.{name}"

    def op(self, op_type: str, inputs: list[str], outputs: list[str] | str, domain: str = "", **attrs) -> str:
        outs = [outputs] if isinstance(outputs, str) else outputs
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"{op_type}_{len(self.nodes)}",
                                           domain=domain, **attrs))
        return outs[0]


def packed(name: str, codes: np.ndarray, bits: int) -> onnx.TensorProto:
    """Signed codes as an ONNX INT8 or INT4 tensor (INT4: two to a byte in row-major order, the
    first in the low nibble)."""
    if bits == 8:
        return numpy_helper.from_array(codes.astype(np.int8), name)
    flat = np.append(codes.reshape(-1), np.int8(0)) if codes.size % 2 else codes.reshape(-1)
    raw = ((flat[0::2] & 0x0F) | ((flat[1::2] & 0x0F) << 4)).astype(np.uint8)
    return helper.make_tensor(name, TP.INT4, list(codes.shape), raw.tobytes(), raw=True)


def qdq_weight(g: Builder, w: BlockWeight, name: str, suffix: str = "") -> tuple[str, str]:
    """W's signed codes [K, N] and scales [K/block, N]: the initializers `DequantizeLinear`
    (axis 0, block_size `w.block`, no zero point) reads. `suffix` names a second reader's copy:
    the same bytes (shared_weights.py stores them once) under another name, since ONNX Runtime
    fuses a `DequantizeLinear` into `MatMulNBits` only when the MatMul is its codes' one reader."""
    codes, scales = f"w.{name}.q{suffix}", f"w.{name}.scales{suffix}"
    if codes not in {t.name for t in g.inits}:
        g.inits.append(packed(codes, w.signed_codes(), w.bits))
        g.inits.append(numpy_helper.from_array(np.ascontiguousarray(w.scales.T), scales))
    return codes, scales


def dequantize_linear(g: Builder, w: BlockWeight, name: str, out: str) -> str:
    """`out` = W [K, N] as `DequantizeLinear` of `qdq_weight`'s initializers."""
    codes, scales = qdq_weight(g, w, name)
    return g.op("DequantizeLinear", [codes, scales], out, axis=0, block_size=w.block)


def block_sums(g: Builder, x: str, w: BlockWeight, name: str) -> str:
    """x's sums per block of W's K [..., K/block]: one GEMM by the 0/1 matrix of block membership
    (W's minimum term is these sums · its offsets)."""
    K = w.k
    members = (np.arange(K)[:, None] // w.block == np.arange(-(-K // w.block))[None]).astype(np.float32)
    return g.op("MatMul", [x, g.const(f"block_members_{K}_{w.block}", members)], f"{name}_sums")


def block_matmul(g: Builder, x: str, w: BlockWeight, name: str, accuracy_level: int | None = None) -> str:
    """x [M, K] · W [K, N] (quant.py), plus x's per-block sums · offsets [K/block, N] when W has
    offsets (GGUF Q4_1's minimum, kept exactly). W is `DequantizeLinear` of its signed int4/int8
    codes → `MatMul`: standard ops, which TensorRT reads and ONNX Runtime fuses into the symmetric
    `MatMulNBits` with no zero points (onnxruntime #29853), at the session's
    `session.qdq_matmulnbits_accuracy_level` (the runtime sets ACCURACY_LEVEL): the kernel and the
    bits of writing `MatMulNBits` directly, which `accuracy_level` does instead (the kernel table
    of scripts/quant_kernels.py). The sums are one GEMM by the 0/1 matrix of block membership, and
    the minimum term a `Gemm` whose C is the symmetric product."""
    K, N = w.shape
    y = name if w.offsets is None else f"{name}_sym"
    if accuracy_level is None:
        g.op("MatMul", [x, dequantize_linear(g, w, name, f"{name}_w")], y)
    else:
        g.op("MatMulNBits", [x, g.const(f"{name}.nbits", w.q), g.const(f"{name}.nbits_scales", w.scales)], y,
             domain=MS, K=K, N=N, bits=w.bits, block_size=w.block, accuracy_level=accuracy_level)
    if w.offsets is None:
        return y
    sums = block_sums(g, x, w, name)  # [M, K/block]
    return g.op("Gemm", [sums, g.weight(f"{name}.offsets", w.offsets), y], name)  # sums · offsets + y


def block_gather(g: Builder, ids: str, w: BlockWeight, name: str, out: str) -> str:
    """`out` = rows `ids` [B, S] of the matrix an 8-bit W [K, N] stands for, transposed: [B, S, K],
    each row dequantized as `BlockWeight.dequantize` does (the same fp32 operations, so the same
    bits), from the bytes `block_matmul(..., name)` reads (a copy by name: `qdq_weight`): a tied
    embedding is gathered from its LM head's blocks, so the bundle stores it once."""
    assert w.bits == 8 and w.offsets is None, "an embedding is gathered from 8-bit blocks without offsets"
    codes, scales = qdq_weight(g, w, name, ".gather")
    centred = g.op("Cast", [g.op("Transpose", [g.op("Gather", [codes, ids], f"{out}/q", axis=1)], f"{out}/qt",
                                 perm=[1, 2, 0])], f"{out}/centred", to=TP.FLOAT)  # [B, S, K]
    block_of = g.const(f"{name}.block_of", (np.arange(w.k) // w.block).astype(np.int64))  # [K]
    row_scales = g.op("Transpose", [g.op("Gather", [scales, ids], f"{out}/s", axis=1)], f"{out}/st",
                      perm=[1, 2, 0])  # [B, S, K/block]
    return g.op("Mul", [centred, g.op("Gather", [row_scales, block_of], f"{out}/scales", axis=2)], out)  # [B, S, K]


def embed_from_blocks(model: onnx.ModelProto, head: BlockWeight, name: str = "logits_flat") -> int:
    """Rewrite a graph exported from the torch model (the drafter's) so that each `Gather` over
    the float table that `head` stands for (the tied embedding, [V, d]) gathers from the head's
    8-bit blocks instead (`block_gather`: the same bits), and drop the table: its bytes are the
    target graph's blocks, stored once. Returns how many Gathers were rewritten (0: the graph
    holds no such table, e.g. an untied embedding)."""
    table = np.ascontiguousarray(head.dequantize().T)  # [V, d]
    count = 0
    for graph in subgraphs(model.graph):
        inits = {t.name: t for t in graph.initializer}
        tables = {n for n, t in inits.items() if tuple(t.dims) == table.shape and t.data_type == TP.FLOAT
                  and np.array_equal(numpy_helper.to_array(t), table)}
        if not tables:
            continue
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            if node.op_type != "Gather" or node.input[0] not in tables:
                nodes.append(node)
                continue
            g = Builder()
            block_gather(g, node.input[1], head, name, node.output[0])
            for n in g.nodes:
                n.name = f"{node.output[0]}/{n.name}"
            nodes.extend(g.nodes)
            graph.initializer.extend(t for t in g.inits if t.name not in inits)
            inits.update({t.name: t for t in g.inits})
            count += 1
        del graph.node[:]
        graph.node.extend(nodes)
        kept = [t for t in graph.initializer if t.name not in tables]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return count


def _linear(g: Builder, x: str, name: str, parts: list[BlockWeight] | list[torch.Tensor]) -> str:
    """x · W for W = `parts` side by side along N: quantized blocks, or nn.Linear weights
    ([out, in]) as one fp32 MatMul."""
    if isinstance(parts[0], BlockWeight):
        return block_matmul(g, x, concat_n(parts), name)
    return g.op("MatMul", [x, g.weight(name, torch.cat(parts).T)], name)


def _params(model: TargetModel, weights: dict[str, BlockWeight], names: list[str]) -> list:
    """The named linear weights: their quantized blocks where `weights` has them, else the model's."""
    return [weights[n] if n in weights else model.get_parameter(n) for n in names]


def _head_major(c) -> np.ndarray:
    """The feature order of q with its heads listed group member first: position g·Hkv + kv holds
    query head kv·G + g (of KV head kv). q in this order is [B, S, G, Hkv, D], whose reshape to
    [B, S·G, Hkv·D] is what `_attention` feeds to MultiHeadAttention, with no Transpose."""
    G = c.num_heads // c.num_kv_heads
    heads = [kv * G + g for g in range(G) for kv in range(c.num_kv_heads)]
    return np.concatenate([np.arange(h * c.head_dim, (h + 1) * c.head_dim) for h in heads])


def _attention_weights(model: TargetModel, weights: dict[str, BlockWeight], i: int) -> tuple[list, list, bool]:
    """(q, k, v parts; o part; whether o reads q's head-major order). q's output features are put
    in `_head_major` order (always exact); o's input features too where that moves whole blocks
    of its quantization (else `_attention` restores the heads' order with a Transpose)."""
    q, k, v, o = _params(model, weights, [f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"])
    order = _head_major(model.cfg)
    if isinstance(q, BlockWeight):
        q = take_n(q, order)
        try:
            return [q, k, v], [take_k(o, order)], True
        except ValueError:  # head size not a multiple of o's block
            return [q, k, v], [o], False
    index = torch.from_numpy(order)
    return [q[index], k, v], [o[:, index]], True


def _positions_and_mask(g: Builder, ids: str, starts: str, keys: str, group: int) -> tuple[str, str, str, str]:
    """ids' shape [B, S], S, the rows' positions [B, S] (starts + 0..S-1) and the additive attention mask
    [B, 1, S·rows, key_count] shared by every layer: row j of a request reads cache positions
    0..starts + j (its own key included), never the rest of the buffer. `rows` = the query heads
    per KV head (at least 2: see `_attention`), token-major."""
    zero, one = g.const("i0", np.array(0, np.int64)), g.const("i1", np.array(1, np.int64))
    ids_shape = g.op("Shape", [ids], "ids_shape")
    S = g.op("Gather", [ids_shape, one], "query_len")
    offsets = g.op("Range", [zero, S, one], "query_offsets")  # [S]
    positions = g.op("Add", [g.op("Unsqueeze", [starts, g.const("axis_1", np.array([1], np.int64))], "starts_col"),
                             offsets], "positions")  # [B, S]
    key_pos = g.op("Range", [zero, g.op("Squeeze", [keys], "key_count_scalar"), one], "key_positions")  # [T]
    seen = g.op("LessOrEqual", [key_pos, g.op("Unsqueeze", [positions, g.const("axis_end", np.array([-1], np.int64))],
                                              "positions_col")], "seen")  # [B, S, T]
    mask = g.op("Where", [seen, g.const("zero_f", np.array(0.0, np.float32)),
                          g.const("masked", np.array(MASKED, np.float32))], "mask_rows")  # [B, S, T]
    mask = g.op("Unsqueeze", [mask, g.const("axis_2", np.array([2], np.int64))], "mask_4d")  # [B, S, 1, T]
    mask = g.op("Tile", [mask, g.const("mask_reps", np.array([1, 1, max(group, 2), 1], np.int64))],
                "mask_rows_tiled")  # [B, S, rows, T]
    mask = g.op("Reshape", [mask, g.const("shape_mask", np.array([0, 1, -1, 0], np.int64))],
                "mask")  # [B, 1, S·rows, T]: row s·rows + r is token s
    return ids_shape, S, positions, mask


def _attention(g: Builder, i: int, c, q: str, k: str, v: str, rope: tuple[str, str], positions: str, mask: str,
               starts: str, keys: str, past: tuple[str, str], present: tuple[str, str], head_major_o: bool) -> str:
    """Causal GQA attention of q [B, S, H·D] (heads in `_head_major` order) over the cache, after
    rotating q and k and writing this call's k, v [B, S, Hkv·D] into it at the rows' positions
    (in place: `present` is bound to `past`'s memory). Returns [B·S, H·D], heads in
    `_head_major` order if `head_major_o`, else in the model's order.

    Written so that a row's result does not depend on the call's other rows, nor on key_count
    (the runtime rounds it up to a multiple of 16). One `MultiHeadAttention` node per layer,
    each KV head a "head" of S·G query rows (row s·G + g is query head g, token s):
    - its q·Kᵀ and p·V are MLAS GEMMs of M = S·G rows, never M = 1 (G = 1 repeats the rows;
      MLAS has a separate M = 1 kernel that rounds differently), so decoding (S = 1) and
      verifying take the same kernel, and each output sums over the keys in cache order;
    - its softmax runs row by row (max, then one vector accumulator of exp(s − max) whose lane
      j mod width adds the keys in order), so keys past a row's position, masked by the
      attention bias, add at most exp(−88) each, far below the last bit of a sum that holds
      exp(0) = 1.
    `RotaryEmbedding` rotates q and k as [B, S, heads·D]: its sequence axis must be S, which
    its cos/sin cache (max_position_embeddings rows) bounds, not the S·G attention rows."""
    H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    G = H // Hkv
    w = g.const
    cos, sin = rope
    q = g.op("RotaryEmbedding", [q, positions, cos, sin], f"qr_{i}", domain=MS, num_heads=H, interleaved=0)
    k = g.op("RotaryEmbedding", [k, positions, cos, sin], f"kr_{i}", domain=MS, num_heads=Hkv, interleaved=0)
    to_heads = w("shape_kv_heads", np.array([0, 0, Hkv, D], np.int64))
    caches = []
    for x, buf, out in ((k, past[0], present[0]), (v, past[1], present[1])):
        x = g.op("Transpose", [g.op("Reshape", [x, to_heads], f"{x}_heads")], f"{x}_bhsd", perm=[0, 2, 1, 3])
        g.op("TensorScatter", [buf, x, starts], out, axis=-2)  # [B, Hkv, S_max, D], rows starts..starts+S-1
        caches.append(g.op("Slice", [out, w("i0_1", np.array([0], np.int64)), keys, w("axis_2", np.array([2], np.int64))],
                           f"{out}_read"))  # [B, Hkv, T, D]
    key_cache, value_cache = caches
    # q in head-major order (`_head_major`) as Hkv heads of S·rows query rows: row s·rows + g is
    # query head g of each KV head's group, token s
    if G == 1:  # each row twice: never M = 1
        q = g.op("Concat", [q, q], f"q_twice_{i}", axis=-1)  # [B, S, 2·Hkv·D]
    q = g.op("Reshape", [q, w("shape_q_rows", np.array([0, -1, Hkv * D], np.int64))], f"q_rows_{i}")  # [B, S·rows, Hkv·D]
    o = g.op("MultiHeadAttention", [q, key_cache, value_cache, "", "", mask], f"attn_rows_{i}", domain=MS,
             num_heads=Hkv, scale=1.0 / float(np.sqrt(D)))  # [B, S·rows, Hkv·D]
    if G == 1:
        o = g.op("Reshape", [o, w("shape_o_twice", np.array([-1, 2 * Hkv * D], np.int64))], f"attn_twice_{i}")
        return g.op("Split", [o], [f"attn_{i}", f"attn_dup_{i}"], axis=-1, num_outputs=2)  # [B·S, H·D]
    if head_major_o:  # o_proj reads the heads in this order
        return g.op("Reshape", [o, w("shape_attn_out", np.array([-1, H * D], np.int64))], f"attn_{i}")
    o = g.op("Reshape", [o, w("shape_o_groups", np.array([-1, G, Hkv, D], np.int64))], f"attn_groups_{i}")
    o = g.op("Transpose", [o], f"attn_bshgd_{i}", perm=[0, 2, 1, 3])  # [B·S, Hkv, G, D]: heads in order
    return g.op("Reshape", [o, w("shape_attn_heads", np.array([-1, H * D], np.int64))], f"attn_{i}")


def build_target_ort(model: TargetModel, feature_layer_ids: tuple[int, ...],
                     weights: dict[str, BlockWeight] | None = None) -> onnx.ModelProto:
    """weights: the quantized linear weights by parameter name (precision.py); the others, and
    the embedding, are the model's own (fp32). The hidden stream is 2-D, [B·S, d], so that
    every linear is one matrix product of B·S rows (and GGUF's minimum term a `Gemm`)."""
    weights = weights or {}
    c = model.cfg
    L, H, Hkv, D, eps = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    ids_in, index_in, starts_in, keys_in = TARGET_ORT_INPUTS
    past, (logits_out, features_out, *present) = kv_names(PAST, L), target_ort_outputs(L)
    g = Builder()
    head = weights.get("lm_head.weight")
    shared_head = c.tie_word_embeddings and head is not None  # the embedding is gathered from the head's blocks
    embed = None if shared_head else g.weight("embed_tokens", model.embed_tokens.weight)
    cos, sin = rope_cos_sin(torch.arange(c.max_position_embeddings)[None], D, c.rope_theta)  # [1, max_pos, 1, D]
    rope = g.weight("cos_cache", cos[0, :, 0, :D // 2]), g.weight("sin_cache", sin[0, :, 0, :D // 2])
    splits_qkv = g.weight("splits_qkv", np.array([H * D, Hkv * D, Hkv * D], np.int64))
    flat = g.const("shape_2d", np.array([-1, c.hidden_size], np.int64))
    if c.qk_norm:
        shape_q = g.weight("shape_heads_q", np.array([0, 0, H, D], np.int64))
        shape_k = g.weight("shape_heads_k", np.array([0, 0, Hkv, D], np.int64))
        shape_flat = g.const("shape_heads_flat", np.array([0, 0, -1], np.int64))
    ids_shape, S, positions, mask = _positions_and_mask(g, ids_in, starts_in, keys_in, H // Hkv)
    per_token = g.op("Concat", [ids_shape, g.const("i_neg1", np.array([-1], np.int64))], "per_token_shape",
                     axis=0)  # [B, S, -1]
    embedded = (block_gather(g, ids_in, head, "logits_flat", "embedded") if shared_head
                else g.op("Gather", [embed, ids_in], "embedded"))  # [B, S, d]
    resid = g.op("Reshape", [embedded, flat], "resid_0")  # [B·S, d]
    feats = [resid] if -1 in feature_layer_ids else []
    h = g.op("SimplifiedLayerNormalization", [resid, g.weight("norm_in_0", model.layers[0].input_layernorm.weight)],
             hidden_name(0), axis=-1, epsilon=eps)
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        qkv_parts, o_parts, head_major_o = _attention_weights(model, weights, i)
        qkv = _linear(g, h, f"qkv_{i}", qkv_parts)  # [B·S, (H+2Hkv)D], q's heads head-major
        qkv = g.op("Reshape", [qkv, per_token], f"qkv3_{i}")  # [B, S, (H+2Hkv)D]
        g.op("Split", [qkv, splits_qkv], [f"q_{i}", f"k_{i}", f"v_{i}"], axis=-1)
        q, k, v = f"q_{i}", f"k_{i}", f"v_{i}"
        if c.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE
            q = g.op("Reshape", [q, shape_q], f"qh_{i}")
            k = g.op("Reshape", [k, shape_k], f"kh_{i}")
            q = g.op("SimplifiedLayerNormalization", [q, g.weight(f"q_norm_{i}", a.q_norm.weight)], f"qn_{i}",
                     axis=-1, epsilon=eps)
            k = g.op("SimplifiedLayerNormalization", [k, g.weight(f"k_norm_{i}", a.k_norm.weight)], f"kn_{i}",
                     axis=-1, epsilon=eps)
            q, k = g.op("Reshape", [q, shape_flat], f"qf_{i}"), g.op("Reshape", [k, shape_flat], f"kf_{i}")
        o = _attention(g, i, c, q, k, v, rope, positions, mask, starts_in, keys_in, (past[i], past[L + i]),
                       (present[i], present[L + i]), head_major_o)
        o = _linear(g, o, f"o_{i}", o_parts)
        h = g.op("SkipSimplifiedLayerNormalization",
                 [o, resid, g.weight(f"norm_post_{i}", layer.post_attention_layernorm.weight)],
                 [f"hp_{i}", "", "", f"resid_attn_{i}"], domain=MS, epsilon=eps)
        resid = f"resid_attn_{i}"  # residual stream after attention
        gu = _linear(g, h, f"gu_{i}", _params(model, weights, [f"layers.{i}.mlp.{p}_proj.weight"
                                                                 for p in ("gate", "up")]))  # [B·S, 2I]
        g.op("Split", [gu], [f"gate_{i}", f"up_{i}"], axis=-1, num_outputs=2)
        gate, up = f"gate_{i}", f"up_{i}"
        act = g.op("QuickGelu", [gate], f"silu_{i}", domain=MS, alpha=1.0)  # x·sigmoid(x)
        m = _linear(g, g.op("Mul", [act, up], f"act_{i}"), f"mlp_{i}",
                    _params(model, weights, [f"layers.{i}.mlp.down_proj.weight"]))
        next_norm = model.layers[i + 1].input_layernorm.weight if i + 1 < L else model.norm.weight
        h = g.op("SkipSimplifiedLayerNormalization", [m, resid, g.weight(f"norm_next_{i}", next_norm)],
                 [hidden_name(i + 1), "", "", f"resid_{i + 1}"], domain=MS, epsilon=eps)
        resid = f"resid_{i + 1}"  # the output of layer i
        if i in feature_layer_ids:
            feats.append(resid)
    features = g.op("Concat", feats, "features_2d", axis=-1) if feats else resid  # [B·S, m·d]
    g.op("Reshape", [features, per_token], features_out)  # [B, S, m·d]
    d = c.hidden_size
    # logit rows: row logit_index[b, j] of request b is row b·S + logit_index[b, j] of the stream
    zero, one = g.const("i0", np.array(0, np.int64)), g.const("i1", np.array(1, np.int64))
    batch = g.op("Gather", [ids_shape, zero], "batch_size")
    base = g.op("Mul", [g.op("Range", [zero, batch, one], "batch_range"), S], "row_base")  # [B]
    idx = g.op("Add", [index_in, g.op("Unsqueeze", [base, g.const("axis_1", np.array([1], np.int64))], "row_base_col")],
               "rows_index")  # [B, K]
    rows = g.op("Gather", [h, g.op("Reshape", [idx, g.const("shape_1d", np.array([-1], np.int64))], "rows_index_flat")],
                "rows_flat", axis=0)  # [B·K, d]
    if head is not None:
        logits = block_matmul(g, rows, head, "logits_flat")  # [B*K, V]
    else:
        lm = embed if c.tie_word_embeddings else g.weight("lm_head", model.lm_head.weight)
        logits = g.op("Gemm", [rows, lm], "logits_flat", transB=1)  # [B*K, V]; the tied embedding, not a copy
    out_shape = g.op("Concat", [g.op("Shape", [index_in], "k_shape"),
                                g.weight("vocab", np.array([c.vocab_size], np.int64))], "logits_shape", axis=0)
    g.op("Reshape", [logits, out_shape], logits_out)

    inputs = [helper.make_tensor_value_info(ids_in, TP.INT64, ["batch", "query"]),
              helper.make_tensor_value_info(index_in, TP.INT64, ["batch", "rows"]),
              helper.make_tensor_value_info(starts_in, TP.INT64, ["batch"]),
              helper.make_tensor_value_info(keys_in, TP.INT64, [1]),
              *[helper.make_tensor_value_info(n, TP.FLOAT, ["batch", Hkv, "max_seq", D]) for n in past]]
    outputs = [helper.make_tensor_value_info(logits_out, TP.FLOAT, ["batch", "rows", c.vocab_size]),
               helper.make_tensor_value_info(features_out, TP.FLOAT, ["batch", "query", max(len(feats), 1) * d]),
               *[helper.make_tensor_value_info(n, TP.FLOAT, ["batch", Hkv, "max_seq", D]) for n in present]]
    graph = helper.make_graph(g.nodes, "dspark_target_ort", inputs, outputs, g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(MS, 1)],
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

