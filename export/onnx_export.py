"""Export the target and the drafter to ONNX (torch.onnx, dynamo exporter).

Example inputs use sizes >= 2 on every dynamic axis: the exporter specialises 0 and 1."""
from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import onnx
import torch

from dspark.runtime.graph_io import DRAFTER_INPUTS, PAST, TARGET_INPUTS, drafter_outputs, kv_names, target_outputs

from .drafter import Drafter
from .graphs import DrafterGraph, TargetGraph
from .target import TargetModel

OPSET = 18
_B, _S, _P, _SMAX, _K = 2, 3, 5, 16, 2


@contextlib.contextmanager
def quiet_exporters() -> Iterator[None]:
    """Silence the exporting libraries' notes on their own internals while graphs are written:
    torch.onnx's deprecations, dynamic-axis notes and skipped torchvision ops, and ONNX Runtime's
    quantizer's pre-processing hint. None asks anything of a user; errors still raise."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def _save(program, path: Path) -> None:
    """One .onnx file; weights go to external data (`<name>.data`) above 2 GB or always for big graphs."""
    model = program.model_proto
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    onnx.checker.check_model(str(path))


def export_target(model: TargetModel, feature_layer_ids: tuple[int, ...], path: Path) -> list[str]:
    c = model.cfg
    L = c.num_layers
    kv = [torch.zeros(_B, c.num_kv_heads, _SMAX, c.head_dim) for _ in range(2 * L)]
    args = (torch.zeros(_B, _S, dtype=torch.long), torch.arange(_P, _P + _S).expand(_B, _S).contiguous(),
            torch.zeros(_B, _K, dtype=torch.long), torch.zeros(_B, _P), *kv)
    inputs = [*TARGET_INPUTS, *kv_names(PAST, L)]
    outputs = target_outputs(L)
    b, s, p, smax, k = (torch.export.Dim(n, min=1, max=m) for n, m in
                        (("batch", 256), ("query", 4096), ("past", 65536), ("max_seq", 65536), ("rows", 4096)))
    shapes = ({0: b, 1: s}, {0: b, 1: s}, {0: b, 1: k}, {0: b, 1: p}, tuple({0: b, 2: smax} for _ in kv))
    program = torch.onnx.export(TargetGraph(model, feature_layer_ids).eval(), args, input_names=inputs,
                                output_names=outputs, dynamic_shapes=shapes, opset_version=OPSET, dynamo=True,
                                optimize=True, verbose=False)
    _save(program, path)
    return graph_ops(path)


def export_drafter(drafter: Drafter, path: Path, vocab: torch.Tensor | None = None) -> list[str]:
    """The drafter graph with the sequential stage's greedy/sampled `If` (graphs.SequentialStage).
    vocab: a draft vocabulary [K] (draft_vocab.restrict_vocab), or None for the whole vocabulary."""
    c = drafter.cfg
    L, gamma = c.num_layers, c.block_size
    kv = [torch.zeros(_B, c.num_kv_heads, _SMAX, c.head_dim) for _ in range(2 * L)]
    args = (torch.zeros(_B, _S, c.feature_dim), torch.arange(_P, _P + _S + gamma).expand(_B, -1).contiguous(),
            torch.zeros(_B, dtype=torch.long), torch.ones(_B), torch.rand(_B, gamma), torch.zeros(_B, _P),
            torch.zeros(_B, _S), *kv)
    inputs = [*DRAFTER_INPUTS, *kv_names(PAST, L)]
    outputs = drafter_outputs(L)
    b, n, p, smax = (torch.export.Dim(nm, min=1, max=m) for nm, m in
                     (("batch", 256), ("ctx", 4096), ("past", 65536), ("max_seq", 65536)))
    shapes = ({0: b, 1: n}, {0: b, 1: n + gamma}, {0: b}, {0: b}, {0: b}, {0: b, 1: p}, {0: b, 1: n},
              tuple({0: b, 2: smax} for _ in kv))
    program = torch.onnx.export(DrafterGraph(drafter, vocab=vocab).eval(), args, input_names=inputs, output_names=outputs,
                                dynamic_shapes=shapes, opset_version=OPSET, dynamo=True, optimize=True,
                                verbose=False)
    _save(program, path)
    return graph_ops(path)


def greedy_from_cond(cond: Path, path: Path) -> list[str]:
    """The greedy-only drafter graph from an exported drafter graph (`export_drafter`), without a
    second trace: the `If` on "every row is greedy" replaced by its then-branch, `draft_probs`
    dropped from the outputs, and what only fed it removed. The inputs stay (temperature and
    uniforms unread)."""
    model = onnx.load(str(cond))
    g = model.graph
    (node,) = [n for n in g.node if n.op_type == "If"]
    branch = next(a.g for a in node.attribute if a.name == "then_branch")  # taken when every row is greedy
    rename = {b.name: o for b, o in zip(branch.output, node.output)}
    for n in branch.node:  # the branch's nodes, writing the If's outputs (the If itself is dropped)
        n.input[:] = [rename.get(x, x) for x in n.input]
        n.output[:] = [rename.get(o, o) for o in n.output]
    g.initializer.extend(branch.initializer)
    at = list(g.node).index(node)
    nodes = [*g.node[:at], *branch.node, *g.node[at + 1:]]
    probs = set(drafter_outputs(0)) - set(drafter_outputs(0, probs=False))
    kept_outputs = [o for o in g.output if o.name not in probs]
    del g.output[:]
    g.output.extend(kept_outputs)
    needed, live = {o.name for o in g.output}, []
    for n in reversed(nodes):  # topological order: a node is live when something live reads it
        if any(o in needed for o in n.output):
            live.append(n)
            needed.update(n.input)
    del g.node[:]
    g.node.extend(reversed(live))
    kept_weights = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(kept_weights)
    names = {t.name for t in g.initializer} | {x for n in g.node for x in n.output}
    kept_info = [v for v in g.value_info if v.name in names]
    del g.value_info[:]
    g.value_info.extend(kept_info)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    onnx.checker.check_model(str(path))
    return graph_ops(path)


def graph_ops(path: Path) -> list[str]:
    """The distinct `domain::op` of a saved graph's top-level nodes (recorded in the manifest)."""
    model = onnx.load(str(path), load_external_data=False)
    return sorted({f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in model.graph.node})
