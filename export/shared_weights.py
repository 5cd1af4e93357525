"""Each weight once per bundle: every graph's large tensors go into one file, `weights.bin`, and
a tensor that several graphs hold (the two int8 drafter graphs' common weights; the embedding
blocks the target and the drafter share, ort_graph.embed_from_blocks) is stored once and named
by each of them at the same offset.

ONNX lets any number of graphs name one external-data file, each tensor by (offset, length),
and ONNX Runtime reads each graph's tensors from it. Large tensors start at multiples of 64 KiB,
which lets ONNX Runtime map them from the file instead of copying them.

A float tensor whose every value is a bfloat16 (the drafter checkpoint's weights are bf16) is
stored as bf16 and widened by a `Cast` in the graph: the same fp32 numbers, half the bytes;
ONNX Runtime folds the Cast once, when it opens the session."""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import external_data_helper as ext
from onnx import helper, numpy_helper

from .tensorrt_ops import subgraphs

WEIGHTS_FILE = "weights.bin"
ALIGN = 1 << 16  # bytes: where a large tensor starts in the file
ALIGN_FROM = 1 << 20  # tensors of at least this many bytes are aligned; smaller ones are packed
INLINE_BELOW = 1024  # bytes: smaller tensors stay inside the .onnx file


def narrow_bf16(graph: onnx.GraphProto) -> None:
    """Store the graph's bf16-exact float initializers (of at least INLINE_BELOW bytes) as bf16,
    each widened by a Cast to its old name at the top of the graph that holds it. Inputs of
    ONNX Runtime's contrib ops (MatMulNBits' scales) and of `DequantizeLinear` stay as they are:
    those kernels, and the fusion of DequantizeLinear → MatMul into MatMulNBits, take their
    constant inputs as they find them in the file."""
    contrib = {i for g in subgraphs(graph) for n in g.node if n.domain or n.op_type == "DequantizeLinear"
               for i in n.input}
    for g in subgraphs(graph):
        casts = []
        for t in g.initializer:
            if t.data_type != TP.FLOAT or 4 * int(np.prod(t.dims)) < INLINE_BELOW or t.name in contrib:
                continue
            bits = numpy_helper.to_array(t).view(np.uint32)
            if np.any(bits & 0xFFFF):
                continue
            name = t.name
            half = numpy_helper.from_array((bits >> 16).astype(np.uint16), f"{name}.bf16")
            half.data_type = TP.BFLOAT16
            t.CopyFrom(half)
            casts.append(helper.make_node("Cast", [half.name], [name], name=f"{name}/widen", to=TP.FLOAT))
        nodes = [*casts, *g.node]
        del g.node[:]
        g.node.extend(nodes)


def share_weights(directory: Path, graphs: list[str],
                  rewrite: Callable[[str, onnx.ModelProto], None] | None = None) -> dict[str, int]:
    """Rewrite the graphs `directory/<name>` (each with its own external data, as the exporters
    wrote them) to keep their large tensors in `directory/weights.bin`, each distinct tensor once
    (bf16-exact ones narrowed); their old data files are removed. `rewrite(name, model)` may
    change a graph first (ort_graph.embed_from_blocks). Returns {graph: bytes it names in the
    file}."""
    models = {name: onnx.load(str(directory / name), load_external_data=True) for name in graphs}
    old = {f.name for f in directory.iterdir() if f.name.endswith(".onnx.data")}
    stored: dict[bytes, tuple[int, int]] = {}  # content key -> (offset, length)
    named: dict[str, int] = {}
    with open(directory / WEIGHTS_FILE, "wb") as out:
        for name, model in models.items():
            if rewrite is not None:
                rewrite(name, model)
            narrow_bf16(model.graph)
            named[name] = 0
            for t in (t for g in subgraphs(model.graph) for t in g.initializer):
                if not t.HasField("raw_data"):
                    t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t), t.name))
                data = t.raw_data
                if len(data) < INLINE_BELOW:
                    continue
                key = hashlib.sha256(bytes([t.data_type]) + repr(tuple(t.dims)).encode() + data).digest()
                if key not in stored:
                    if len(data) >= ALIGN_FROM:
                        out.write(b"\0" * (-out.tell() % ALIGN))
                    stored[key] = (out.tell(), len(data))
                    out.write(data)
                offset, length = stored[key]
                ext.set_external_data(t, WEIGHTS_FILE, offset, length)
                t.data_location = TP.EXTERNAL
                t.ClearField("raw_data")
                named[name] += length
    for name, model in models.items():
        onnx.save_model(model, str(directory / name))
    for location in old:
        (directory / location).unlink()
    return named
