"""The throughput model of the prefix scheduler (dspark.md §5): SPS(B), the target's
verification steps per second at B batch tokens, profiled once per engine by
`dspark profile` and stored in the bundle as `sps.json`, and Θ = τ · SPS(B)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import BundleError

SPS_FILE = "sps.json"
SPS_FORMAT = 1


@dataclass(frozen=True)
class SpsTable:
    sps: tuple[float, ...]  # SPS(B) for B = 1..len(sps): steps per second
    draft_s: tuple[float, ...] = ()  # the drafter's seconds per pass at R = 1..len(draft_s) rows

    def __post_init__(self) -> None:
        if not self.sps or any(not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0) for v in self.sps):
            raise ValueError("sps must be a non-empty list of finite numbers > 0")
        if any(not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0) for v in self.draft_s):
            raise ValueError("draft_s must hold finite numbers >= 0")

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

    def save(self, bundle: Path, meta: dict) -> Path:
        path = Path(bundle) / SPS_FILE
        path.write_text(json.dumps({"format": SPS_FORMAT, "sps": list(self.sps), "draft_s": list(self.draft_s),
                                    "meta": meta}, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, bundle: Path) -> "SpsTable | None":
        """The bundle's table, None when it has none; a corrupt one is a BundleError."""
        path = Path(bundle) / SPS_FILE
        if not path.exists():
            return None
        try:
            d = json.loads(path.read_text())
            if d.get("format") != SPS_FORMAT:
                raise ValueError(f"format is {d.get('format')!r}, expected {SPS_FORMAT}")
            return cls(tuple(d["sps"]), tuple(d.get("draft_s", ())))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BundleError(f"{path} is corrupt ({e}); re-run `dspark profile --bundle {bundle}`") from e


@dataclass(frozen=True)
class CostModel:
    """Θ of a verification plan ℓ [R].

    padded: B = R·(1 + max ℓ), what a static-shape engine (ONNX Runtime, TensorRT) pays for a
    right-padded batch; otherwise B = Σ(1 + ℓ_r) as dspark.md writes it (equal at R = 1).
    drafter: Θ = τ / (1/SPS(B) + t_draft(R)), counting the drafter's pass in the cycle
    (beyond the paper); otherwise Θ = τ · SPS(B) exactly."""

    sps: SpsTable
    padded: bool = True
    drafter: bool = False

    def batch_tokens(self, ells: np.ndarray) -> int:
        return len(ells) * (1 + int(ells.max())) if self.padded else int(len(ells) + ells.sum())

    def theta(self, tau: float, ells: np.ndarray) -> float:
        B = self.batch_tokens(ells)
        if not self.drafter:
            return tau * self.sps(B)
        return tau / (1.0 / self.sps(B) + self.sps.draft_time(len(ells)))

    def theta_alone(self, rows: int) -> float:
        """Θ of a step without drafting: every request emits one token, B = R, no drafter pass."""
        return rows * self.sps(rows)
