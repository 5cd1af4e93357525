"""Every op of the exported graphs is one that TensorRT 11.4's ONNX parser accepts (a static
check against the support matrix kept in export/tensorrt_ops.py), and so are the quantized
weights' DequantizeLinear → MatMul (blocked int4, per-channel int8) that TensorRT reads."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dspark.export.tensorrt_ops import OPSET_RANGE, TENSORRT_VERSION, check_graph, graph_ops
from dspark.runtime.backends.onnxruntime import session_options


def test_exported_graphs_use_only_tensorrt_ops(tiny_bundle):
    for name in ("target.onnx", "drafter.onnx"):
        path = tiny_bundle.path / name
        assert check_graph(path) == [], f"{name} ({graph_ops(path)})"
    assert "CumSum" in graph_ops(tiny_bundle.path / "drafter.onnx")  # the sequential stage is in the graph


def _graph(tmp_path, nodes, inits=(), opset=18):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], list(inits)),
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "g.onnx"
    onnx.save(model, str(path))
    return path


def test_check_rejects_unsupported_and_contrib_ops(tmp_path):
    p = _graph(tmp_path, [helper.make_node("Unique", ["x"], ["y"], name="u")])
    assert any(f"Unique is not supported by TensorRT {TENSORRT_VERSION}" in m for m in check_graph(p))
    p = _graph(tmp_path, [helper.make_node("SimplifiedLayerNormalization", ["x"], ["y"], name="s",
                                           domain="com.microsoft")])
    assert any("com.microsoft::SimplifiedLayerNormalization" in m for m in check_graph(p))


def test_check_requires_constant_axes_and_opset(tmp_path):
    axis = helper.make_tensor_value_info("axis", TensorProto.INT64, [])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("CumSum", ["x", "axis"], ["y"], name="c")], "g", [x, axis], [y])
    path = tmp_path / "c.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    assert any("CumSum input 1 (axis) must be a constant" in m for m in check_graph(path))
    const_axis = helper.make_tensor("axis", TensorProto.INT64, [], [1])
    ok = _graph(tmp_path, [helper.make_node("CumSum", ["x", "axis"], ["y"], name="c")], [const_axis])
    assert check_graph(ok) == []
    old = _graph(tmp_path, [helper.make_node("Relu", ["x"], ["y"], name="r")], opset=7)
    assert any("opset 7" in m for m in check_graph(old))


def test_check_looks_inside_if_branches(tmp_path):
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    bad = helper.make_graph([helper.make_node("Unique", ["x"], ["y"], name="inner_unique")], "then", [], [y])
    good = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="inner_relu")], "else", [], [y])
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], name="if", then_branch=bad, else_branch=good)],
                              "g", [cond, x], [y])
    path = tmp_path / "if.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    assert any("inner_unique: Unique" in m for m in check_graph(path))
    assert {"If", "Unique", "Relu"} <= set(graph_ops(path))


def _dq_matmul(tmp_path, codes_type=TensorProto.INT4, k=64, n=16, block=32, axis=0, zero=None, codes_shape=None,
               extra_nodes=(), opset=21):
    """x [M, K] · DequantizeLinear(codes [K, N], scales) → y: blocks of `block` rows along K (axis 0)
    with scales [K/block, N], or per channel (block 0, axis 1) with scales [N]."""
    rng = np.random.default_rng(0)
    shape = codes_shape or [k, n]
    values = rng.integers(0 if codes_type == TensorProto.UINT8 else -8, 8, int(np.prod(shape))).tolist()
    codes = helper.make_tensor("w.q", codes_type, shape, values)
    scales = numpy_helper.from_array(rng.uniform(0.01, 0.1, [k // block, n] if block else [n]).astype(np.float32),
                                     "w.scales")
    inputs, inits = ["w.q", "w.scales"], [codes, scales]
    if zero is not None:
        inits.append(helper.make_tensor("w.zero", codes_type, list(scales.dims), [zero] * int(np.prod(scales.dims))))
        inputs.append("w.zero")
    attrs = {"axis": axis, **({"block_size": block} if block else {})}
    nodes = [helper.make_node("DequantizeLinear", inputs, ["w"], name="dq", **attrs),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), *extra_nodes]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])
    model = helper.make_model(helper.make_graph(nodes, "dq", [x], [y], inits), opset_imports=[helper.make_opsetid("", opset)])
    path = tmp_path / "dq.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("codes_type, block, axis", [(TensorProto.INT4, 32, 0), (TensorProto.INT8, 0, 1),
                                                     (TensorProto.INT8, 32, 0)])
def test_quantized_weights_are_read(tmp_path, codes_type, block, axis):
    """Blocked int4 along K and per-channel int8 weights, as standard-domain DequantizeLinear (opset
    21, where block_size came in) feeding MatMul: accepted, and a valid graph (ONNX Runtime runs it)."""
    assert OPSET_RANGE[0] <= 21 <= OPSET_RANGE[1]
    path = _dq_matmul(tmp_path, codes_type, block=block, axis=axis)
    assert check_graph(path) == []
    session = ort.InferenceSession(str(path), session_options(1), providers=["CPUExecutionProvider"])
    y = session.run(None, {"x": np.ones((2, 64), np.float32)})
    assert y[0].shape == (2, 16)


def test_check_refuses_what_tensorrt_cannot_dequantize(tmp_path):
    def problems(**kw):
        return " | ".join(check_graph(_dq_matmul(tmp_path, **kw)))

    assert "DequantizeLinear of UINT8 w.q: TensorRT dequantizes INT8, INT4, FP8, FP4 only" in \
        problems(codes_type=TensorProto.UINT8, block=0, axis=1)
    assert "zero point w.zero is not zero" in problems(zero=1)
    assert problems(zero=0) == ""
    assert "blocks axis 0 of a rank-3 tensor" in problems(codes_shape=[64, 2, 16])
    gather = helper.make_node("Gather", ["w.q", "ids"], ["rows"], name="g", axis=0)  # int8 rows, not dequantized
    ids = helper.make_tensor("ids", TensorProto.INT64, [1], [0])
    path = _dq_matmul(tmp_path, TensorProto.INT8, block=0, axis=1, extra_nodes=[gather])
    model = onnx.load(str(path))
    model.graph.initializer.append(ids)
    onnx.save(model, str(path))
    assert "g: Gather reads w.q, an INT8 tensor: TensorRT takes quantized types only through DequantizeLinear" in \
        " | ".join(check_graph(path))
