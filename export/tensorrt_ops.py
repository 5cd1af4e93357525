"""ONNX operators accepted by one named TensorRT release, and a static check of our graphs.

The release: TensorRT 11.4 (tensorrt-cu13 and tensorrt-cu12 11.4.0.106 on PyPI), which parses
opsets 9 to 24. Sources: the ONNX-TensorRT parser's operator support matrix (docs/operators.md
of onnx/onnx-tensorrt) as of TensorRT 10.15, plus the parser changes that NVIDIA/TensorRT's
release notes list for 11.0 to 11.5 (github.com/NVIDIA/TensorRT/releases): 11.0 added Swish
(and TRT_Attention, TRT_MoE, TRT_KVCacheUpdate, outside the standard domain), 11.2 added DFT
and 5-D GridSample, 11.1, 11.3 and 11.4 added no operator, and opset 25 came with 11.5. The
11.x operators.md itself was not at hand. Only operators marked supported are listed;
restrictions that our graphs could violate are checked below, among them the matrix's rule for
quantized types (INT8, INT4, FP8 and FP4 enter a network only through DequantizeLinear, with a
zero zero point) and the IDequantizeLayer's (a build-time constant scale; blocks along one of
the last two axes). This is a static check of the graphs, not a TensorRT build."""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, numpy_helper

TENSORRT_VERSION = "11.4"
OPSET_RANGE = (9, 24)

SUPPORTED = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization
BlackmanWindow Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh
CumSum DeformConv DepthToSpace DequantizeLinear DFT Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike
Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool
Greater GreaterOrEqual GridSample GroupNormalization GRU HammingWindow HannWindow HardSigmoid HardSwish
Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less
LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean
MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean
ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RMSNormalization RNN
RoiAlign RotaryEmbedding Round STFT ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink
Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Swish Tan
Tanh TensorScatter ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

# Inputs that TensorRT needs as build-time constants: op -> input index.
CONSTANT_INPUTS = {"CumSum": 1, "ReduceMean": 1, "ReduceSum": 1, "ReduceMax": 1, "Squeeze": 1, "Unsqueeze": 1,
                   "DequantizeLinear": 1}
# TensorRT's quantized types: what DequantizeLinear reads, and nothing else does (FP8 is E4M3).
QUANTIZED = {TensorProto.INT8: "INT8", TensorProto.INT4: "INT4", TensorProto.FLOAT8E4M3FN: "FP8",
             TensorProto.FLOAT4E2M1: "FP4"}


def subgraphs(graph: onnx.GraphProto):
    """`graph` and every graph inside it (If/Loop/Scan branches, at any depth)."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from subgraphs(attr.g)


def walk_nodes(graph: onnx.GraphProto):
    """Every node of `graph`, including those inside If/Loop/Scan branches."""
    for g in subgraphs(graph):
        yield from g.node


def check_graph(path: str | Path) -> list[str]:
    """Problems that would stop TensorRT from parsing the graph (empty = none found)."""
    model = onnx.load(str(path), load_external_data=False)
    problems = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or not OPSET_RANGE[0] <= opset <= OPSET_RANGE[1]:
        problems.append(f"opset {opset} is outside TensorRT {TENSORRT_VERSION}'s range {OPSET_RANGE}")
    nodes = list(walk_nodes(model.graph))
    values = {i.name: i for g in subgraphs(model.graph) for i in g.initializer}
    values |= {n.output[0]: a.t for n in nodes if n.op_type == "Constant" for a in n.attribute if a.name == "value"}
    constants = set(values) | {o for n in nodes if n.op_type == "Constant" for o in n.output}
    for node in nodes:
        if node.domain not in ("", "ai.onnx"):
            problems.append(f"{node.name}: {node.domain}::{node.op_type} is not a standard ONNX operator")
        elif node.op_type not in SUPPORTED:
            problems.append(f"{node.name}: {node.op_type} is not supported by TensorRT {TENSORRT_VERSION}")
        idx = CONSTANT_INPUTS.get(node.op_type)
        if idx is not None and len(node.input) > idx and node.input[idx] and node.input[idx] not in constants:
            problems.append(f"{node.name}: {node.op_type} input {idx} ({node.input[idx]}) must be a constant")
        if node.op_type == "DequantizeLinear":
            problems += dequantize_problems(node, values)
        else:
            problems += [f"{node.name}: {node.op_type} reads {x}, an {QUANTIZED[values[x].data_type]} tensor: TensorRT "
                         f"takes quantized types only through DequantizeLinear"
                         for x in node.input if x in values and values[x].data_type in QUANTIZED]
    return problems


def dequantize_problems(node: onnx.NodeProto, values: dict[str, onnx.TensorProto]) -> list[str]:
    """What TensorRT refuses in a DequantizeLinear whose inputs are constants: another input
    type, a zero point that is not zero, blocks along an axis other than the last two."""
    x = values.get(node.input[0])
    if x is None:  # an activation's: its type and rank are not known here
        return []
    problems = []
    if x.data_type not in QUANTIZED:
        problems.append(f"{node.name}: DequantizeLinear of {TensorProto.DataType.Name(x.data_type)} {node.input[0]}: "
                        f"TensorRT dequantizes {', '.join(QUANTIZED.values())} only")
    zero = values.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if zero is not None and zero.data_location != TensorProto.EXTERNAL and numpy_helper.to_array(zero).any():
        problems.append(f"{node.name}: DequantizeLinear's zero point {node.input[2]} is not zero (TensorRT's is)")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    rank = len(x.dims)
    if attrs.get("block_size", 0) and rank and attrs.get("axis", 1) % rank not in (rank - 1, rank - 2):
        problems.append(f"{node.name}: DequantizeLinear blocks axis {attrs.get('axis', 1)} of a rank-{rank} tensor: "
                        f"TensorRT blocks one of the last two axes")
    return problems


def graph_ops(path: str | Path) -> list[str]:
    model = onnx.load(str(path), load_external_data=False)
    return sorted({n.op_type for n in walk_nodes(model.graph)})
