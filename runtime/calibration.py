"""Calibrated survival probabilities a_k = c_1·…·c_k with c_k = sigmoid(logit_k / t_k), the
per-position temperatures fitted by Sequential Temperature Scaling (dspark.md §4) and
stored in the bundle as `calibration.json` by `dspark calibrate`. Numpy only.

A calibration belongs to the drafter–target pair, not to the machine: the file names the
drafter and target sources (their hashes, as the manifest records them) and the target's
precision it was fitted on (`binding`), and a bundle of another pair refuses it. A drafter
checkpoint may ship one (`calibration.json` beside its weights); `dspark export` puts it in
the bundle when it was fitted on the same pair."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import BundleError, InputError
from .manifest import Manifest
from .sampling import sigmoid

CALIBRATION_FILE = "calibration.json"
CALIBRATION_FORMAT = 2  # 2: the drafter-target pair it was fitted on ("for")


def binding(manifest: Manifest) -> dict[str, str]:
    """The drafter-target pair of a bundle, as a calibration names it."""
    return {"drafter": manifest.source_hashes.get("drafter", ""), "target": manifest.source_hashes.get("target", ""),
            "precision": manifest.precision}


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
        """Into the bundle, bound to its drafter-target pair."""
        path = Path(bundle) / CALIBRATION_FILE
        path.write_text(json.dumps({"format": CALIBRATION_FORMAT, "temperatures": list(self.temperatures),
                                    "for": binding(Manifest.load(bundle)), "meta": meta}, indent=1) + "\n")
        return path

    @classmethod
    def read(cls, path: Path, fix: str) -> tuple["Calibration", dict[str, str]]:
        """(the calibration in `path`, the pair it was fitted on); a corrupt file is a BundleError
        that ends with `fix`."""
        try:
            d = json.loads(Path(path).read_text())
            if d.get("format") != CALIBRATION_FORMAT:
                raise ValueError(f"format is {d.get('format')!r}, expected {CALIBRATION_FORMAT}")
            pair = {k: str(d["for"][k]) for k in ("drafter", "target", "precision")}
            return cls(tuple(d["temperatures"])), pair
        except (ValueError, KeyError, TypeError, AttributeError, InputError) as e:
            raise BundleError(f"{path} is corrupt ({e}); {fix}") from e

    @classmethod
    def load(cls, bundle: Path, manifest: Manifest) -> "Calibration | None":
        """The bundle's calibration, None when it has none; a corrupt one, or one fitted on
        another drafter, target or precision, is a BundleError."""
        path = Path(bundle) / CALIBRATION_FILE
        if not path.exists():
            return None
        fix = f"re-run `dspark calibrate --bundle {bundle}`"
        cal, pair = cls.read(path, fix)
        ours = binding(manifest)
        for key, what in (("drafter", "drafter"), ("target", "target model"), ("precision", "target precision")):
            if pair[key] != ours[key]:
                raise BundleError(f"{path} was fitted on another {what} ({key} {pair[key][:16]}, this bundle's is "
                                  f"{ours[key][:16]}); {fix}")
        gamma = manifest.drafter.block_size
        if len(cal.temperatures) != gamma:
            raise BundleError(f"{path} has {len(cal.temperatures)} temperatures, the drafter's block is {gamma}; {fix}")
        return cal
