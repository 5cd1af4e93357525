"""The throughput model of the prefix scheduler (dspark.md §5): SPS(B), the target's
verification steps per second at B batch tokens, profiled once per engine by
`dspark profile` and stored in the bundle as `sps.json`, and Θ = τ · SPS(B)."""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .cpu import cpu_signature, differs
from .errors import BundleError

SPS_FILE = "sps.json"
SPS_FORMAT = 1


def _all(values, positive: bool) -> bool:
    """Every value a finite number, > 0 (positive) or >= 0."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               and (v > 0 if positive else v >= 0) for v in values)


@dataclass(frozen=True)
class SpsTable:
    sps: tuple[float, ...]  # SPS(B) for B = 1..len(sps): steps per second
    draft_s: tuple[float, ...] = ()  # the drafter's seconds per pass at R = 1..len(draft_s) rows
    grid: tuple[tuple[float, ...], ...] = ()  # grid[R-1][S-1]: steps per second at R rows of S tokens
    # draft_s of each drafter graph profiled ("int8-greedy", "int8", "fp32"): an engine takes the one it runs
    draft_by_graph: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.sps or not _all(self.sps, positive=True):
            raise ValueError("sps must be a non-empty list of finite numbers > 0")
        if not all(_all(v, positive=False) for v in (self.draft_s, *self.draft_by_graph.values())):
            raise ValueError("draft_s must hold finite numbers >= 0")
        if not all(isinstance(row, (list, tuple)) and row and _all(row, positive=True) for row in self.grid):
            raise ValueError("grid must be a list of non-empty lists of finite numbers > 0")

    def rate(self, rows: int, tokens: int) -> float:
        """Steps per second of a batch of `rows` rows of `tokens` tokens each: the profiled grid
        where it has the shape, else SPS(rows · tokens)."""
        if rows <= len(self.grid) and tokens <= len(self.grid[rows - 1]):
            return self.grid[rows - 1][tokens - 1]
        return self(rows * tokens)

    def __call__(self, B: int) -> float:
        """SPS(B). Past the profiled range a step is assumed to cost in proportion to B."""
        n = len(self.sps)
        return self.sps[B - 1] if B <= n else self.sps[-1] * n / B

    def draft_time(self, rows: int) -> float:
        """Seconds of one drafter pass over `rows` requests (0 when not profiled); linear past the range."""
        n = len(self.draft_s)
        if n == 0:
            return 0.0
        return self.draft_s[rows - 1] if rows <= n else self.draft_s[-1] * rows / n

    def for_drafter(self, graph: str) -> "SpsTable":
        """The table with the drafter cost of `graph` when it was profiled (else unchanged)."""
        return replace(self, draft_s=self.draft_by_graph[graph]) if graph in self.draft_by_graph else self

    def save(self, bundle: Path, meta: dict) -> Path:
        """meta: how it was measured ("precision": the target's; "cpu": cpu.cpu_signature())."""
        path = Path(bundle) / SPS_FILE
        path.write_text(json.dumps({"format": SPS_FORMAT, "sps": list(self.sps), "draft_s": list(self.draft_s),
                                    "draft_s_by_graph": {k: list(v) for k, v in self.draft_by_graph.items()},
                                    "grid": [list(r) for r in self.grid], "meta": meta}, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, bundle: Path, precision: str = "fp32") -> "SpsTable | None":
        """The bundle's table, None when it has none; a corrupt one, or one measured on a target of
        another precision than `precision` (the bundle's), is a BundleError. One measured on
        another CPU (other vector instructions or cores) is used with a warning: its speeds are
        another machine's."""
        path = Path(bundle) / SPS_FILE
        if not path.exists():
            return None
        try:
            d = json.loads(path.read_text())
            if d.get("format") != SPS_FORMAT:
                raise ValueError(f"format is {d.get('format')!r}, expected {SPS_FORMAT}")
            measured = d.get("meta", {}).get("precision", "fp32")
            if measured != precision:
                raise BundleError(f"{path} was measured on a {measured} target, this bundle's is {precision}; "
                                  f"re-run `dspark profile --bundle {bundle}`")
            cpu = d.get("meta", {}).get("cpu")
            other = differs(cpu, cpu_signature()) if isinstance(cpu, dict) else None
            if other:
                warnings.warn(f"{path} was measured on another CPU ({cpu.get('model')}: {other}); the scheduler "
                              f"plans with its speeds: re-run `dspark profile --bundle {bundle}` on this machine",
                              stacklevel=2)
            return cls(tuple(d["sps"]), tuple(d.get("draft_s", ())), tuple(tuple(r) for r in d.get("grid", ())),
                       {str(k): tuple(v) for k, v in d.get("draft_s_by_graph", {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BundleError(f"{path} is corrupt ({e}); re-run `dspark profile --bundle {bundle}`") from e


@dataclass(frozen=True)
class CostModel:
    """Θ of a verification plan ℓ [R].

    padded: R rows of 1 + max ℓ tokens (B = R·(1 + max ℓ)), what a static-shape engine (ONNX
    Runtime, TensorRT) pays for a right-padded batch, at the profiled rate of that shape;
    otherwise B = Σ(1 + ℓ_r) and SPS(B) as dspark.md writes it (the same B at R = 1).
    drafter: Θ = τ / (1/SPS(B) + t_draft(R)), counting the drafter's pass in the cycle
    (beyond the paper); otherwise Θ = τ · SPS(B) exactly."""

    sps: SpsTable
    padded: bool = True
    drafter: bool = False

    def steps_per_s(self, ells: np.ndarray) -> float:
        if self.padded:
            return self.sps.rate(len(ells), 1 + int(ells.max()))
        return self.sps(int(len(ells) + ells.sum()))

    def theta(self, tau: float, ells: np.ndarray) -> float:
        sps = self.steps_per_s(ells)
        if not self.drafter:
            return tau * sps
        return tau / (1.0 / sps + self.sps.draft_time(len(ells)))

    def theta_alone(self, rows: int) -> float:
        """Θ of a step without drafting: every request emits one token, B = R, no drafter pass."""
        return rows * self.sps.rate(rows, 1)
