"""Calibrated survival probabilities a_k = c_1·…·c_k with c_k = sigmoid(logit_k / t_k), the
per-position temperatures fitted by Sequential Temperature Scaling (dspark.md §4) and
stored in the bundle as `calibration.json` by `dspark calibrate`. Numpy only."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import BundleError, InputError
from .sampling import sigmoid

CALIBRATION_FILE = "calibration.json"
CALIBRATION_FORMAT = 1


@dataclass(frozen=True)
class Calibration:
    temperatures: tuple[float, ...]  # t_k for block slots k = 1..γ

    def __post_init__(self) -> None:
        for k, t in enumerate(self.temperatures):
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
                raise InputError(f"calibration temperature of slot {k + 1} is {t!r}, expected a finite number > 0")

    @classmethod
    def identity(cls, gamma: int) -> "Calibration":
        return cls((1.0,) * gamma)

    def survival(self, confidence_logits: np.ndarray) -> np.ndarray:
        """confidence_logits [R, γ] -> a [R, γ], non-increasing along γ."""
        if confidence_logits.shape[-1] != len(self.temperatures):
            raise InputError(f"confidence logits have {confidence_logits.shape[-1]} slots, the calibration "
                             f"{len(self.temperatures)}; re-run `dspark calibrate`")
        return np.cumprod(sigmoid(confidence_logits / np.asarray(self.temperatures)), axis=-1)

    def save(self, bundle: Path, meta: dict) -> Path:
        path = Path(bundle) / CALIBRATION_FILE
        path.write_text(json.dumps({"format": CALIBRATION_FORMAT, "temperatures": list(self.temperatures),
                                    "meta": meta}, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, bundle: Path, gamma: int) -> "Calibration | None":
        """The bundle's calibration, None when it has none; a corrupt one is a BundleError."""
        path = Path(bundle) / CALIBRATION_FILE
        if not path.exists():
            return None
        fix = f"re-run `dspark calibrate --bundle {bundle}`"
        try:
            d = json.loads(path.read_text())
            if d.get("format") != CALIBRATION_FORMAT:
                raise ValueError(f"format is {d.get('format')!r}, expected {CALIBRATION_FORMAT}")
            cal = cls(tuple(d["temperatures"]))
        except (ValueError, KeyError, TypeError, AttributeError, InputError) as e:
            raise BundleError(f"{path} is corrupt ({e}); {fix}") from e
        if len(cal.temperatures) != gamma:
            raise BundleError(f"{path} has {len(cal.temperatures)} temperatures, the drafter's block is {gamma}; {fix}")
        return cal
