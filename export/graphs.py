"""The engine graphs: the target and the drafter as exportable step functions over static,
preallocated KV caches, with the inputs and outputs named in `dspark.runtime.graph_io`.

Each graph reads a whole cache buffer [B, Hkv, S_max, D] per layer (pointer-stable for
IOBinding and CUDA graphs), looks only at its first P rows, where P is the width of
`past_mask` [B, P], and returns only the new K/V rows, which the runtime writes into its
buffers. The math is the models' own (TargetModel.forward, Drafter.backbone/sequential);
a wrapper slices the buffers and applies in-place transforms to its own copy of a model:
the fused projections (layers.fuse_projections) and the draft vocabulary
(draft_vocab.restrict_vocab)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from .draft_vocab import restrict_vocab
from .drafter import Drafter
from .layers import fuse_projections
from .target import TargetModel


def committed(buffers: tuple[torch.Tensor, ...], rows: int) -> list[torch.Tensor]:
    """The first `rows` rows of each cache buffer [B, Hkv, S_max, D] (narrowed, not sliced: the
    exporter then knows each view has exactly `rows` rows, not min(rows, S_max))."""
    return [b.narrow(2, 0, rows) for b in buffers]


class TargetGraph(nn.Module):
    """Prefill and verification in one graph (graph_io: the target graph).

    Weights are rearranged for the engine, not changed: q/k/v and gate/up projections are one
    matrix each, the attention scale is folded into the query weights, and Qwen3's q/k norm
    runs once over the queries and keys together."""

    def __init__(self, model: TargetModel, feature_layer_ids: tuple[int, ...]):
        super().__init__()
        self.model = copy.deepcopy(model)  # the graph's own: the caller's model stays as it is
        fuse_projections(self.model)
        self.feature_layer_ids = tuple(feature_layer_ids)

    def forward(self, input_ids, positions, logit_index, past_mask, *past):
        L, P = self.model.cfg.num_layers, past_mask.shape[1]
        past = committed(past, P)
        logits, features, keys, values = self.model(input_ids, positions, past_mask, past[:L], past[L:], logit_index,
                                                    self.feature_layer_ids)
        return (logits, features, *keys, *values)


BRANCHES = ("cond", "sampled")


class SequentialStage(nn.Module):
    """Which form of `Drafter.sequential` the graph holds. A module of its own so that
    profiles can attribute its nodes.

    branch: "cond" = an `If` takes a branch without the softmax and cumulative sums over the
    vocabulary when every row is greedy (one graph for every temperature); "sampled" = always
    the sampled branch (exact for greedy rows too, no host sync on a condition, so a CUDA
    graph can capture it). The greedy-only ONNX graph, for calls whose rows all have T = 0, is
    the "cond" graph's greedy branch without its distributions (onnx_export.greedy_from_cond)."""

    def __init__(self, drafter: Drafter, branch: str = "cond"):
        super().__init__()
        if branch not in BRANCHES:
            raise ValueError(f"branch {branch!r} is not one of {BRANCHES}")
        self.drafter = drafter
        self.branch = branch

    def forward(self, h, base, anchor, temperature, uniforms):
        """h [B, γ, d], base [B, γ, K] -> tokens [B, γ], probs [B, γ, V], confidence [B, γ]."""
        if self.branch == "sampled":
            return self.sampled(h, base, anchor, temperature, uniforms)
        return torch.cond((temperature <= 0).all(), self.greedy, self.sampled, (h, base, anchor, temperature, uniforms))

    def greedy(self, h, base, anchor, temperature, uniforms):
        out = self.drafter.sequential(h, base, anchor)
        return out.tokens, out.probs, out.confidence_logits

    def sampled(self, h, base, anchor, temperature, uniforms):
        out = self.drafter.sequential(h, base, anchor, temperature, uniforms)
        return out.tokens, out.probs, out.confidence_logits


class DrafterGraph(nn.Module):
    """Backbone + the γ-step sequential stage, unrolled, with randomness as an input
    (graph_io: the drafter graph).

    vocab: a draft vocabulary (restrict_vocab); the outputs keep the whole vocabulary's ids and
    width. The projections are fused as in the target graph, but Qwen3's q and k norms stay two
    norms with a [D] weight each, which ONNX Runtime fuses into one op each."""

    def __init__(self, drafter: Drafter, branch: str = "cond", vocab: torch.Tensor | None = None):
        super().__init__()
        drafter = copy.deepcopy(drafter)  # the graph's own: the caller's drafter stays as it is
        if vocab is not None:
            restrict_vocab(drafter, vocab)
        fuse_projections(drafter, join_qk_norm=False)
        self.drafter = drafter
        self.sequential = SequentialStage(drafter, branch)

    def forward(self, features, positions, anchor, temperature, uniforms, past_mask, ctx_mask, *past):
        d = self.drafter
        L, P = d.cfg.num_layers, past_mask.shape[1]
        past = committed(past, P)
        block = torch.zeros_like(ctx_mask[:, :1]).expand(-1, d.cfg.block_size)
        mask = torch.cat([past_mask, ctx_mask, block], dim=1)[:, None]  # [B, 1, P + n + γ]
        h, ctx_keys, ctx_values = d.backbone(features, d.block(anchor), positions, mask, past[:L], past[L:])
        tokens, probs, conf = self.sequential(h, d.lm_head(h), anchor, temperature, uniforms)
        return (tokens, probs, conf, *ctx_keys, *ctx_values)
