"""One engine step (target or drafter) on the device: its static input buffers and CUDA graphs,
one per bucket, keyed by the first request slot of the call and the shapes of its inputs. After
every launch the step's new K/V rows are written into the caches at the positions the call
passed, from device memory, so a replayed graph writes where its current inputs say."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ...graph_io import kv_names
from .device import Device, Outputs


class Step(Protocol):
    """One engine graph (target or drafter), as the exported ONNX graphs define it."""

    def prepare(self, inputs: dict[str, Any], kv: list[Any], graphed: bool) -> Callable[[], Outputs]:
        """Bind static inputs (device arrays by input name, batch B first) and the KV caches of the
        call's B slots (views [B, Hkv, S_max, D]; keys of every layer, then values) for one shape.
        Returns launch(): enqueue the step, return its outputs by name. `graphed`: launch() will be
        captured in a CUDA graph."""
        ...


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0
    launch_s: float = 0.0  # host time spent enqueueing replays and eager runs (captures excluded)
    capture_failures: list[str] = field(default_factory=list)


@dataclass
class Entry:
    inputs: dict[str, Any]  # static input buffers
    run: Callable[[], Outputs]  # replay (returns the static outputs) or the eager body
    graphed: bool  # run() replays a captured graph


class StepRunner:
    """Static buffers and graphs of one step, keyed by the first slot and the shapes of its inputs."""

    def __init__(self, device: Device, step: Step, kv: list[Any], prefix: str, layers: int, graphs: bool):
        """kv: the caches [R, Hkv, S_max, D], keys of every layer then values."""
        self.device, self.step, self.kv, self.prefix, self.layers, self.graphs = device, step, kv, prefix, layers, graphs
        self.entries: dict[tuple, Entry] = {}
        self.stats = GraphStats()

    def __call__(self, host: dict[str, np.ndarray], lo: int, rows: int, keep: bool) -> Outputs:
        """Run the step on host inputs (batch B) over slots lo..lo+B-1; the first `rows` positions of
        each row get their new K/V rows written. keep: cache this bucket's buffers (and its graph when
        graphs are on)."""
        key = (lo, *((name, a.shape) for name, a in host.items()))
        entry = self.entries.get(key)
        if entry is None:
            entry = self._new(host, lo, graphed=keep and self.graphs)
            if keep:
                self.entries[key] = entry
        else:
            for name, a in host.items():
                self.device.upload(entry.inputs[name], a)
        t0 = time.perf_counter()
        out = entry.run()
        self.stats.launch_s += time.perf_counter() - t0
        return out

    def _new(self, host: dict[str, np.ndarray], lo: int, graphed: bool) -> Entry:
        d = self.device
        inputs = {name: d.zeros(a.shape, a.dtype) for name, a in host.items()}
        for name, a in host.items():  # before any launch: the warm-up writes real KV rows
            d.upload(inputs[name], a)
        B = len(host["positions"])
        kv = [cache[lo:lo + B] for cache in self.kv]  # views [B, Hkv, S_max, D] of this call's slots
        launch = self.step.prepare(inputs, kv, graphed)
        positions = inputs["positions"]
        names = kv_names(self.prefix, self.layers)

        def body() -> Outputs:
            out = launch()
            for cache, name in zip(kv, names):
                d.write_rows(cache, out[name], positions)
            return out

        if graphed:
            try:
                replay, outputs = d.capture(body)
            except Exception as e:  # noqa: BLE001 — a step that cannot be captured still runs, eagerly
                self.stats.capture_failures.append(f"{key_text(host)}: {type(e).__name__}: {e}")
            else:
                self.stats.captures += 1

                def run() -> Outputs:
                    replay()
                    self.stats.replays += 1
                    return outputs

                return Entry(inputs, run, True)

        def eager() -> Outputs:
            self.stats.eager += 1
            return body()

        return Entry(inputs, eager, False)


def key_text(host: dict[str, np.ndarray]) -> str:
    return ", ".join(f"{name}{list(a.shape)}" for name, a in host.items())
