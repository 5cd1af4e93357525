"""A backend's engine time, by kind of run: the timing hook that `dspark profile` and the
benchmark scripts share.

    timer = RunTimer()
    engine.backend.on_run = timer      # every engine run now reports to it
    ...
    timer.seconds["drafter"], timer.runs["target"]
"""
from __future__ import annotations

from collections import defaultdict

from .base import RunEvent


class RunTimer:
    """Sums the seconds and counts the runs of each kind ("prefill", "target", "drafter")."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.runs: defaultdict[str, int] = defaultdict(int)

    def __call__(self, event: RunEvent) -> None:
        self.seconds[event.kind] += event.seconds
        self.runs[event.kind] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.runs.clear()
