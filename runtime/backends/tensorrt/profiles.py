"""Optimization profiles of the TensorRT engines, derived from the manifest, and the
precisions an engine may be built in. Pure logic, shared by the builder and the backend.

Two profiles per engine: 0 "prefill" (batch 1, up to `prefill_chunk` rows a call) and
1 "verify" (batch 1..max_batch, up to γ+1 rows). Every profile covers contexts 1..max_seq;
the KV inputs are the whole preallocated cache [B, Hkv, max_seq, D]."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ...errors import BackendError, InputError
from ...graph_io import PAST, DrafterInputs, TargetInputs, kv_names
from ...manifest import Manifest

Shape = tuple[int, ...]
Profile = dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)
PROFILE_NAMES = ("prefill", "verify")


@dataclass(frozen=True)
class EngineShapes:
    max_seq: int  # KV rows (and the longest context)
    max_query: int  # γ + 1
    max_batch: int = 1
    prefill_chunk: int = 512

    def __post_init__(self) -> None:
        if self.max_seq < 2 or self.max_query < 1 or self.max_batch < 1 or self.prefill_chunk < self.max_query:
            raise InputError(f"bad engine shapes {self}: need max_seq >= 2, max_query, max_batch >= 1 and "
                             f"prefill_chunk >= max_query")

    @classmethod
    def for_manifest(cls, m: Manifest, max_seq: int | None = None, max_batch: int = 1,
                     prefill_chunk: int = 512) -> "EngineShapes":
        limit = m.target.max_position_embeddings
        max_seq = min(2048, limit) if max_seq is None else max_seq
        if not 1 < max_seq <= limit:
            raise InputError(f"max_seq is {max_seq}, expected 2..{limit} (the target's max_position_embeddings)")
        return cls(max_seq, m.drafter.block_size + 1, max_batch, min(prefill_chunk, max_seq))

    def to_dict(self) -> dict:
        return asdict(self)


def _kv(layers: int, heads: int, head_dim: int, s: EngineShapes, batch: tuple[int, int, int]) -> Profile:
    shapes = tuple((b, heads, s.max_seq, head_dim) for b in batch)
    return dict.fromkeys(kv_names(PAST, layers), shapes)


def _dims(s: EngineShapes, profile: str) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(batch min/opt/max, rows min/opt/max) of a profile."""
    if profile == "prefill":
        return (1, 1, 1), (1, s.prefill_chunk, s.prefill_chunk)
    return (1, 1, s.max_batch), (1, s.max_query, s.max_query)


def _past(s: EngineShapes, batch: tuple[int, int, int]) -> tuple[Shape, Shape, Shape]:
    opt = min(s.max_seq, 512)  # a typical context; TensorRT tunes kernels for the opt shape
    return (batch[0], 1), (batch[1], opt), (batch[2], s.max_seq)


def target_profiles(m: Manifest, s: EngineShapes) -> dict[str, Profile]:
    t = m.target
    out = {}
    for name in PROFILE_NAMES:
        b, q = _dims(s, name)
        rows = tuple((bi, qi) for bi, qi in zip(b, q))
        out[name] = {**TargetInputs(input_ids=rows, positions=rows, logit_index=rows, past_mask=_past(s, b))._asdict(),
                     **_kv(t.num_layers, t.num_kv_heads, t.head_dim, s, b)}
    return out


def drafter_profiles(m: Manifest, s: EngineShapes) -> dict[str, Profile]:
    d = m.drafter
    g = d.block_size
    out = {}
    for name in PROFILE_NAMES:
        b, q = _dims(s, name)
        inputs = DrafterInputs(features=tuple((bi, qi, d.feature_dim) for bi, qi in zip(b, q)),
                               positions=tuple((bi, qi + g) for bi, qi in zip(b, q)),
                               anchor=tuple((bi,) for bi in b), temperature=tuple((bi,) for bi in b),
                               uniforms=tuple((bi, g) for bi in b), past_mask=_past(s, b),
                               ctx_mask=tuple((bi, qi) for bi, qi in zip(b, q)))
        out[name] = {**inputs._asdict(), **_kv(d.num_layers, d.num_kv_heads, d.head_dim, s, b)}
    return out


def profile_index(s: EngineShapes, batch: int, rows: int) -> int:
    """The profile a call runs under: verify for up to γ+1 rows, prefill (batch 1) above."""
    if batch <= s.max_batch and rows <= s.max_query:
        return PROFILE_NAMES.index("verify")
    if batch == 1 and rows <= s.prefill_chunk:
        return PROFILE_NAMES.index("prefill")
    raise InputError(f"a call of batch {batch} x {rows} rows is outside the engine's profiles ({s})")


@dataclass(frozen=True)
class Precision:
    graph_dtype: str  # the dtype the ONNX graphs must have been exported in (strongly typed networks)
    min_compute: tuple[int, int]  # the oldest GPU architecture that has it
    tf32: bool  # fp32 graphs: let TensorRT use TF32 tensor cores for fp32 matmuls
    atol: float  # validation tolerances against ONNX Runtime fp32 (|a - b| <= atol + rtol·|ref|)
    rtol: float


PRECISIONS = {
    "fp32": Precision("float32", (0, 0), False, 1e-3, 1e-3),
    "tf32": Precision("float32", (8, 0), True, 3e-2, 1e-2),
    "fp16": Precision("float16", (5, 3), False, 5e-2, 2e-2),
    "bf16": Precision("bfloat16", (8, 0), False, 1.5e-1, 5e-2),
}


def check_precision(precision: str, graph_dtype: str, compute: tuple[int, int] | None) -> Precision:
    """TensorRT 11 networks are strongly typed (11 removed the FP16/BF16 builder flags): a
    precision is a property of the ONNX graph, not a builder flag; only TF32 remains a flag.
    `compute` None: not checked (no GPU known)."""
    if precision not in PRECISIONS:
        raise InputError(f"unknown precision {precision!r}; choose one of {sorted(PRECISIONS)}")
    p = PRECISIONS[precision]
    if p.graph_dtype != graph_dtype:
        raise BackendError(f"precision {precision} needs graphs exported in {p.graph_dtype}; this bundle's graphs are "
                           f"{graph_dtype} (strongly typed TensorRT builds in the graph's own types). Build "
                           f"with --precision fp32 or tf32, or export the graphs in {p.graph_dtype}")
    if compute is not None and compute < p.min_compute:
        raise BackendError(f"precision {precision} needs a GPU of compute capability {p.min_compute[0]}."
                           f"{p.min_compute[1]} or newer; this GPU is {compute[0]}.{compute[1]}")
    return p
