"""ONNX operators accepted by one named TensorRT release, and a static check of our graphs.

Source: the ONNX-TensorRT parser's operator support matrix (docs/operators.md of
onnx/onnx-tensorrt) for TensorRT 10.15, which parses opsets 9 to 24. Only operators
marked supported are listed; restrictions that our graphs could violate are checked
below. This is a static check of the graphs, not a TensorRT build."""
from __future__ import annotations

from pathlib import Path

import onnx

TENSORRT_VERSION = "10.15"
OPSET_RANGE = (9, 24)

SUPPORTED = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization
BlackmanWindow Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh
CumSum DeformConv DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike
Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool
Greater GreaterOrEqual GridSample GroupNormalization GRU HammingWindow HannWindow HardSigmoid HardSwish
Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less
LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean
MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean
ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RMSNormalization RNN
RoiAlign RotaryEmbedding Round STFT ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink
Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan
Tanh TensorScatter ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

# Inputs that TensorRT needs as build-time constants: op -> input index.
CONSTANT_INPUTS = {"CumSum": 1, "ReduceMean": 1, "ReduceSum": 1, "ReduceMax": 1, "Squeeze": 1, "Unsqueeze": 1}


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
    constants = {i.name for i in model.graph.initializer}
    constants |= {o for n in nodes if n.op_type == "Constant" for o in n.output}
    for node in nodes:
        if node.domain not in ("", "ai.onnx"):
            problems.append(f"{node.name}: {node.domain}::{node.op_type} is not a standard ONNX operator")
        elif node.op_type not in SUPPORTED:
            problems.append(f"{node.name}: {node.op_type} is not supported by TensorRT {TENSORRT_VERSION}")
        idx = CONSTANT_INPUTS.get(node.op_type)
        if idx is not None and len(node.input) > idx and node.input[idx] and node.input[idx] not in constants:
            problems.append(f"{node.name}: {node.op_type} input {idx} ({node.input[idx]}) must be a constant")
    return problems


def graph_ops(path: str | Path) -> list[str]:
    model = onnx.load(str(path), load_external_data=False)
    return sorted({n.op_type for n in walk_nodes(model.graph)})
