"""Every op of the exported graphs is one that TensorRT 10.15's ONNX parser accepts
(a static check against the support matrix kept in export/tensorrt_ops.py)."""
import onnx
from onnx import TensorProto, helper

from dspark.export.tensorrt_ops import TENSORRT_VERSION, check_graph, graph_ops


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
