"""Scheduler choice by name (`--scheduler`, `Engine.generate(scheduler=...)`).

    none       the target alone
    fixed      verify all γ drafts
    threshold  verify up to the first raw confidence below a threshold (DeepSpec's control)
    prefix     Algorithm 1 with the causal early stop (dspark.md §5)
    async      the asynchronous variant: capacity from confidences two steps old, top-K admission
    cost       prefix + the drafter's cost in Θ + skipping the drafter when it does not pay
    auto       when the bundle has an SPS table (`dspark profile`) and a calibration (`dspark
               calibrate`): cost if the table has the drafter's cost (profiles since it was
               measured), else prefix; otherwise a warning and `fixed`
"""
from __future__ import annotations

import warnings

from ..calibration import Calibration
from ..errors import InputError
from ..throughput import CostModel, SpsTable
from .base import History, Scheduler
from .prefix import AsyncPrefixScheduler, PrefixScheduler
from .static import FixedLength, StaticThreshold

__all__ = ["AsyncPrefixScheduler", "FixedLength", "History", "NAMES", "PrefixScheduler", "Scheduler",
           "StaticThreshold", "make_scheduler"]

NAMES = ("auto", "none", "fixed", "threshold", "prefix", "async", "cost")


def make_scheduler(name: str, threshold: float = 0.5, sps: SpsTable | None = None,
                   calibration: Calibration | None = None, bundle: str = "DIR") -> Scheduler | None:
    if name == "auto":
        if sps is None or calibration is None:
            missing = " and ".join(w for w, v in (("an SPS table (run `dspark profile --bundle {b}`)", sps),
                                                 ("a calibration (run `dspark calibrate --bundle {b}`)", calibration))
                                   if v is None).format(b=bundle)
            warnings.warn(f"bundle {bundle} lacks {missing}: scheduling falls back to `fixed` (verify all γ drafts)",
                          stacklevel=2)
            return FixedLength()
        name = "cost" if sps.draft_s else "prefix"
    if name == "none":
        return None
    if name == "fixed":
        return FixedLength()
    if name == "threshold":
        return StaticThreshold(threshold)
    if name not in NAMES:
        raise InputError(f"unknown scheduler {name!r}; choose one of {', '.join(NAMES)}")
    if sps is None:
        raise InputError(f"scheduler {name!r} needs the bundle's SPS table: run `dspark profile --bundle {bundle}`")
    if calibration is None:
        raise InputError(f"scheduler {name!r} needs the bundle's calibration: run `dspark calibrate --bundle {bundle}`")
    if name == "prefix":
        return PrefixScheduler(calibration, CostModel(sps))
    if name == "async":
        return AsyncPrefixScheduler(calibration, CostModel(sps))
    return PrefixScheduler(calibration, CostModel(sps, drafter=True), skip_drafting=True, name="cost")
