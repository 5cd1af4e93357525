"""The engine graphs' interface: input and output names and the constants both sides share.

The exporter (`dspark.export`) writes graphs with these names; every backend binds them by
these names. Nothing here imports torch or onnxruntime.

Target graph (portable; TensorRT reads it too):
    inputs   input_ids [B, S] int64, positions [B, S] int64, logit_index [B, K] int64 (rows whose
             logits are wanted), past_mask [B, P] f32, past_key_i / past_value_i [B, Hkv, S_max, D]
    outputs  logits [B, K, V], features [B, S, m·d], new_key_i / new_value_i [B, Hkv, S, D]
Target graph for ONNX Runtime (writes its K/V rows in place; present_* bound to the past_* buffers):
    inputs   input_ids, logit_index, starts [B] int64 (each row's first position), key_count [1] int64
             (cache positions attention reads, >= max(starts) + S), past_key_i / past_value_i
    outputs  logits, features, present_key_i / present_value_i
Drafter graph:
    inputs   features [B, n, m·d], positions [B, n + γ] int64, anchor [B] int64, temperature [B] f32,
             uniforms [B, γ] f32, past_mask [B, P] f32, ctx_mask [B, n] f32, past_key_i / past_value_i
    outputs  draft_tokens [B, γ] int64, draft_probs [B, γ, V] (not in the greedy-only graph),
             confidence_logits [B, γ], ctx_key_i / ctx_value_i [B, Hkv, n, D]
"""
from __future__ import annotations

from typing import Any, NamedTuple

MASKED = -1e9  # additive attention mask value of a row that must not be read


class TargetInputs(NamedTuple):
    """The portable target graph's inputs before the past K/V (a backend feeds `._asdict()`)."""

    input_ids: Any  # [B, S] int64
    positions: Any  # [B, S] int64
    logit_index: Any  # [B, K] int64
    past_mask: Any  # [B, P] f32


class TargetOrtInputs(NamedTuple):
    """The ONNX Runtime target graph's inputs before the past K/V."""

    input_ids: Any  # [B, S] int64
    logit_index: Any  # [B, K] int64
    starts: Any  # [B] int64
    key_count: Any  # [1] int64


class DrafterInputs(NamedTuple):
    """The drafter graph's inputs before the past K/V."""

    features: Any  # [B, n, m·d] f32
    positions: Any  # [B, n + γ] int64
    anchor: Any  # [B] int64
    temperature: Any  # [B] f32
    uniforms: Any  # [B, γ] f32
    past_mask: Any  # [B, P] f32
    ctx_mask: Any  # [B, n] f32


TARGET_INPUTS = TargetInputs._fields
TARGET_ORT_INPUTS = TargetOrtInputs._fields
DRAFTER_INPUTS = DrafterInputs._fields

PAST, NEW, CTX, PRESENT = "past", "new", "ctx", "present"  # K/V name prefixes: cache in, rows out, in place


def kv_names(prefix: str, layers: int) -> list[str]:
    """Per-layer K/V tensor names: keys of every layer, then values (`past_key_0`, ..., `past_value_0`, ...)."""
    return [f"{prefix}_key_{i}" for i in range(layers)] + [f"{prefix}_value_{i}" for i in range(layers)]


def target_outputs(layers: int) -> list[str]:
    return ["logits", "features", *kv_names(NEW, layers)]


def target_ort_outputs(layers: int) -> list[str]:
    return ["logits", "features", *kv_names(PRESENT, layers)]


def drafter_outputs(layers: int, probs: bool = True) -> list[str]:
    """probs=False: the greedy-only graph, whose one-hot distributions nobody reads (the T = 0
    acceptance rule compares tokens)."""
    return ["draft_tokens", *(["draft_probs"] if probs else []), "confidence_logits", *kv_names(CTX, layers)]
