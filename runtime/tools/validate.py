"""`dspark validate`: a backend's outputs against ONNX Runtime's on the same inputs, step by
step (prefill, greedy and sampled drafting, verification), with tolerances per precision,
then greedy identity of short generations in the floating-point sense of dspark.md §1.

A quantized bundle's ONNX Runtime graph computes with int8 activations, another arithmetic
than any fp32 backend of the same weights (docs/quantization.md): against it, target logits
are compared as distributions and features relative to their scale (`QuantizedBound`), and a
greedy split is allowed where the reference's top-2 gap is below the largest logit difference
measured on the same inputs.

Comparisons use polygraphy's `CompareFunc.simple` where polygraphy is installed and numpy
(|a - b| <= atol + rtol·|ref| everywhere) otherwise."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..backends import BACKENDS as ENGINE_BACKENDS
from ..backends import Backend, BackendOptions, StepBatch, open_backend
from ..backends.tensorrt.profiles import PRECISIONS
from ..core import generate
from ..errors import BackendError, InputError
from ..manifest import Manifest
from ..request import SamplingParams
from ..schedulers import FixedLength
from .parity import NEAR_TIE, GreedyMatch, greedy_match

TORCH_BACKENDS = ("torch", "torch-cuda-graph")  # the PyTorch reference models, from the export side
BACKENDS = (*ENGINE_BACKENDS, *TORCH_BACKENDS)
VALIDATE_MAX_SEQ = 512


@dataclass
class Comparison:
    name: str
    max_abs: float
    ok: bool
    method: str  # "polygraphy" | "numpy" | "exact"


@dataclass(frozen=True)
class QuantizedBound:
    """How far an fp32-arithmetic backend may be from a quantized bundle's ONNX Runtime graph.
    The default `gguf` bundle against the torch reference (2026-12-06, docs/results.md): mean KL
    0.007 over prompt rows, the worst row 0.042, top-1 agreement 0.97, features 0.023 of a
    row's largest magnitude; the bounds are about 5 times that."""
    mean_kl: float = 0.05  # mean over rows of KL(softmax(reference) || softmax(candidate))
    feature_rel: float = 0.1  # per row: max |difference| / max |reference|


@dataclass
class Validation:
    candidate: str
    reference: str
    precision: str
    atol: float
    rtol: float
    comparisons: list[Comparison] = field(default_factory=list)
    greedy: list[GreedyMatch] = field(default_factory=list)
    quantized: QuantizedBound | None = None  # the target's bounds against a quantized bundle's graph
    near_tie: float = NEAR_TIE  # a greedy split at a reference top-2 gap below this is allowed

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons) and all(g.ok for g in self.greedy)

    def to_dict(self) -> dict:
        return {**asdict(self), "greedy": [{**asdict(g), "verdict": str(g)} for g in self.greedy], "ok": self.ok}

    def lines(self) -> list[str]:
        out = [f"{self.candidate} vs {self.reference} ({self.precision}: atol {self.atol:g}, rtol {self.rtol:g})"]
        if self.quantized is not None:
            out.append(f"  the reference is a quantized graph (int8 activations): target logits within mean KL "
                       f"{self.quantized.mean_kl:g}, features within {self.quantized.feature_rel:g} of their scale, "
                       f"greedy splits allowed below a top-2 gap of {self.near_tie:.3g} (the largest logit difference)")
        out += [f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: max |diff| {c.max_abs:.3g} ({c.method})"
                for c in self.comparisons]
        out += [f"  {'ok  ' if g.ok else 'FAIL'} greedy generation {i}: {g}" for i, g in enumerate(self.greedy)]
        return out + [f"{'PASS' if self.ok else 'FAIL'}"]


def compare(name: str, ref: np.ndarray, got: np.ndarray, atol: float, rtol: float) -> Comparison:
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.shape != got.shape:
        return Comparison(f"{name} (shapes {ref.shape} vs {got.shape})", float("inf"), False, "shape")
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    max_abs = float(diff.max()) if diff.size else 0.0
    try:
        from polygraphy.comparator import CompareFunc, IterationResult
    except ImportError:
        return Comparison(name, max_abs, bool((diff <= atol + rtol * np.abs(ref)).all()), "numpy")
    result = CompareFunc.simple(atol=atol, rtol=rtol)(IterationResult(outputs={name: ref}, runner_name="reference"),
                                                      IterationResult(outputs={name: got}, runner_name="candidate"))
    return Comparison(name, max_abs, bool(result[name]), "polygraphy")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def compare_logits(name: str, ref: np.ndarray, got: np.ndarray, bound: QuantizedBound) -> Comparison:
    """Logits [..., V] as distributions: mean KL(ref || got) over rows within the bound."""
    log_p, log_q = log_softmax(ref), log_softmax(got)
    kl = float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())
    diff = float(np.abs(got.astype(np.float64) - ref).max())
    return Comparison(f"{name} (mean KL {kl:.3g}, top-1 agreement {top1:.2f})", diff,
                      kl <= bound.mean_kl, "distribution")


def compare_relative(name: str, ref: np.ndarray, got: np.ndarray, bound: QuantizedBound) -> Comparison:
    """Rows [..., F]: the largest difference within `feature_rel` of the row's largest magnitude."""
    diff = np.abs(got.astype(np.float64) - ref)
    rel = float((diff.max(-1) / np.maximum(np.abs(ref).max(-1), 1e-30)).max())
    return Comparison(f"{name} (relative {rel:.3g})", float(diff.max()), rel <= bound.feature_rel, "relative")


def validate(reference: Backend, candidate: Backend, prompts: Sequence[Sequence[int]], names: tuple[str, str],
             precision: str = "fp32", max_new_tokens: int = 32, stop_token_ids: tuple[int, ...] = (),
             seed: int = 0, quantized: QuantizedBound | None = None) -> Validation:
    """Both backends get the same inputs at every step (the reference's features and drafts).
    quantized: the reference is a quantized bundle's graph, the candidate another arithmetic."""
    p = PRECISIONS[precision]
    v = Validation(names[1], names[0], precision, p.atol, p.rtol, quantized=quantized)
    largest = 0.0  # the largest target logit difference seen: a greedy split below it is arithmetic

    def check(name: str, ref: np.ndarray, got: np.ndarray) -> None:
        nonlocal largest
        if quantized is None or not name.startswith(("prefill", "verify")):
            v.comparisons.append(compare(name, ref, got, p.atol, p.rtol))
        elif name.endswith("logits"):
            v.comparisons.append(compare_logits(name, ref, got, quantized))
            largest = max(largest, v.comparisons[-1].max_abs)
        else:
            v.comparisons.append(compare_relative(name, ref, got, quantized))

    ids = np.asarray(prompts[0], np.int64)
    n, gamma = len(ids), reference.block_size
    zero = np.zeros(1, np.int64)  # starts [1]: one request row, in slot 0
    (lr, fr), (lc, fc) = reference.target(ids[None], zero), candidate.target(ids[None], zero)  # [1, n, V], [1, n, F]
    check("prefill logits", lr, lc)
    check("prefill features", fr, fc)
    anchor = int(np.argmax(lr[0, -1]))
    u = np.random.default_rng(seed).random((1, gamma))
    for T in (0.0, 1.0):
        batch = draft_batch(fr, n, anchor, T, u)  # every prompt row as context
        dr, dc = reference.draft(batch), candidate.draft(batch)
        if dr.probs is not None and dc.probs is not None:  # None at T = 0 from a greedy-only graph, whose
            check(f"draft probs (T={T:g})", dr.probs, dc.probs)  # one-hots the exact token check covers
        check(f"confidence logits (T={T:g})", dr.confidence_logits, dc.confidence_logits)
        same = dr.tokens.tolist() == dc.tokens.tolist()
        v.comparisons.append(Comparison(f"draft tokens (T={T:g})", 0.0 if same else float("nan"), same, "exact"))
    block = np.concatenate([[anchor], dr.tokens[0]]).astype(np.int64)[None]  # [1, γ + 1]
    (lr, fr), (lc, fc) = reference.target(block, zero + n), candidate.target(block, zero + n)
    check("verify logits", lr, lc)
    check("verify features", fr, fc)
    if quantized is not None:
        v.near_tie = max(NEAR_TIE, largest)
    params = SamplingParams(0.0, max_new_tokens, seed, stop_token_ids=stop_token_ids)
    for prompt in prompts:
        ref = generate(reference, prompt, params, FixedLength()).token_ids
        got = generate(candidate, prompt, params, FixedLength()).token_ids
        (logits,), _ = reference.target(np.asarray([*prompt, *ref[:-1]], np.int64)[None], zero)
        v.greedy.append(greedy_match(ref, got, logits[len(prompt) - 1:], v.near_tie))  # row n-1+i produced ref[i]
    return v


def draft_batch(features: np.ndarray, start: int, anchor: int, temperature: float, u: np.ndarray,
                floor: int = 0) -> StepBatch:
    """One request in slot 0 whose drafter has seen nothing: features [1, n, F] of positions
    start-n..start-1, the anchor at `start`, draft uniforms u [1, γ]."""
    gamma = u.shape[1]
    uniforms = np.zeros((1, 2 * gamma + 1))
    uniforms[:, :gamma] = u
    return StepBatch(features, np.array([features.shape[1]]), np.array([floor]), np.array([start]),
                     np.array([anchor]), np.array([temperature]), uniforms, np.zeros(1, np.int64))


def open_any_backend(name: str, bundle: Path, manifest: Manifest, max_seq: int | None,
                     target: str | None = None, drafter: str | None = None) -> Backend:
    """An engine backend from the registry, or a PyTorch reference backend loaded from the models the
    bundle was exported from. ONNX Runtime drafts with the exported fp32 drafter here: the int8 one
    (the CPU default) proposes from another distribution by design."""
    if name not in BACKENDS:
        raise InputError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name in ENGINE_BACKENDS:
        if name != "tensorrt":
            max_seq = max_seq or min(VALIDATE_MAX_SEQ, manifest.target.max_position_embeddings)
        return open_backend(name, bundle, manifest, BackendOptions(max_seq=max_seq, drafter_graph="fp32"))
    try:
        from dspark.export.backends import torch_backend
    except ImportError as e:
        raise BackendError(f"backend {name} runs the PyTorch reference models: it needs the export extra "
                           f"(pip install 'dspark-trt[export]'): {e}") from e
    return torch_backend(name, manifest, max_seq or min(VALIDATE_MAX_SEQ, manifest.target.max_position_embeddings),
                         target, drafter)
