"""The portable target graph of a quantized bundle, in the QDQ form TensorRT reads.

The portable graph (`target.onnx`) is traced from the torch model, which holds the numbers the
quantized weights stand for (precision.dequantize_into) as fp32 matrices. This pass puts the
blocks back: each weight matrix the trace holds that equals a `BlockWeight`'s dequantized W
becomes `DequantizeLinear` of its signed codes (ort_graph.qdq_weight: the initializers of the
ONNX Runtime graph, so a bundle stores the shared ones once) feeding the same `MatMul`, plus the
Q4_1 minimum's block-sum term. The tied embedding's `Gather`, and the head where the trace
multiplies by the table's `Transpose` instead of a transposed copy, read the head's blocks. What
the trace fuses differently from the ONNX Runtime graph (q in its natural head order with the
attention scale folded in; o's input rows in that order) keeps codes of its own.

A weight is put back only where its blocks give exactly the trace's numbers: q with the scale
folded in needs the scale to be a power of two (head size 64: 1/8); otherwise that matrix stays
fp32 and `qdq_portable` says how many did."""
from __future__ import annotations

import hashlib
import math

import numpy as np
import onnx

from .ort_graph import Builder, block_sums, dequantize_linear
from .precision import linear_names
from .quant import BlockWeight, concat_n
from .target import TargetModel
from .tensorrt_ops import subgraphs

QDQ_OPSET = 21  # blocked and int4 DequantizeLinear
QDQ_IR = 10  # int4 tensors


def _digest(a: np.ndarray) -> bytes:
    """A key of an fp32 matrix's values (not a copy of its bytes)."""
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).data).digest()


def scaled(w: BlockWeight, s: float) -> BlockWeight:
    """W·s, exactly when s is a power of two (scales and offsets scaled, codes unchanged)."""
    return BlockWeight(w.q, w.scales * np.float32(s), w.bits, w.block, w.k,
                       None if w.offsets is None else w.offsets * np.float32(s))


def traced_blocks(model: TargetModel, weights: dict[str, BlockWeight]) -> list[BlockWeight]:
    """The blocks of every weight matrix the traced graph holds: each quantized linear, and the
    fused q·scale/k/v and gate/up of layers.TargetModel's forward."""
    out = [weights[n] for n in linear_names(model) if n in weights]
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        gate, up = (weights.get(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up"))
        if gate is not None and up is not None:
            out.append(concat_n([gate, up]))
        q, k, v = (weights.get(f"{p}self_attn.{n}_proj.weight") for n in "qkv")
        if q is None or k is None or v is None:
            continue
        s = 1.0 if layer.self_attn.qk_norm else layer.self_attn.scale
        if math.frexp(s)[0] == 0.5:  # a power of two: W·s is exact
            out.append(concat_n([scaled(q, s), k, v]))
    return out


def qdq_portable(model: onnx.ModelProto, blocks: list[BlockWeight]) -> tuple[int, int]:
    """Rewrite the traced graph in place (see the module docstring); returns (matrices put back
    as blocks, MatMul weights of a quantized shape left fp32)."""
    by_digest = {_digest(w.dequantize()): w for w in blocks}
    shapes = {w.shape for w in blocks}
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    g, nodes, done, left, dropped = Builder(), [], 0, 0, set()

    def blocks_of(name: str, transposed: bool = False) -> BlockWeight | None:
        t = inits.get(name)
        if t is None or t.data_type != onnx.TensorProto.FLOAT or len(t.dims) != 2:
            return None
        dims = tuple(t.dims)[::-1] if transposed else tuple(t.dims)
        if dims not in shapes:
            return None
        arr = onnx.numpy_helper.to_array(t)
        return by_digest.get(_digest(arr.T if transposed else arr))

    for node in graph.node:
        first = len(g.nodes)
        w = blocks_of(node.input[1]) if node.op_type == "MatMul" else None
        table = blocks_of(node.input[0], transposed=True) if node.op_type == "Gather" else None
        flipped = (blocks_of(node.input[0], transposed=True) if node.op_type == "Transpose"
                   and [list(a.ints) for a in node.attribute if a.name == "perm"] == [[1, 0]] else None)
        if flipped is not None and flipped.offsets is None:  # MatMul(x, Transpose(table)): the tied head
            dequantize_linear(g, flipped, "logits_flat", node.output[0])  # [d, V]
        elif w is not None:
            x, y, name = node.input[0], node.output[0], node.input[1]
            dq = dequantize_linear(g, w, name, f"{name}/dq")
            if w.offsets is None:
                g.op("MatMul", [x, dq], y)
            else:  # [B, S, K]: the minimum term as MatMul + Add (Gemm is 2-D)
                g.op("Add", [g.op("MatMul", [x, dq], f"{y}/sym"),
                             g.op("MatMul", [block_sums(g, x, w, y), g.weight(f"{name}.offsets", w.offsets)],
                                  f"{y}/minimum")], y)
        elif table is not None and table.offsets is None:  # the tied embedding: the head's rows, dequantized
            name = node.input[0]
            dq = dequantize_linear(g, table, "logits_flat", f"{name}/dq")  # the head's own initializers, [d, V]
            g.op("Gather", [g.op("Transpose", [dq], f"{name}/rows", perm=[1, 0]), node.input[1]], node.output[0])
        else:
            kept_weight = inits.get(node.input[1]) if node.op_type == "MatMul" else None
            left += kept_weight is not None and tuple(kept_weight.dims) in shapes
            nodes.append(node)
            continue
        dropped.add(node.input[1] if node.op_type == "MatMul" else node.input[0])  # Gather, Transpose: the table
        for n in g.nodes[first:]:
            n.name = f"qdq/{n.name}"  # apart from the trace's names
        nodes.extend(g.nodes[first:])
        done += 1
    still_used = {i for sub in subgraphs(graph) for n in (nodes if sub is graph else sub.node) for i in n.input}
    kept = [t for t in graph.initializer if t.name not in dropped or t.name in still_used]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + g.inits)
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            op.version = max(op.version, QDQ_OPSET)
    model.ir_version = max(model.ir_version, QDQ_IR)
    return done, left

