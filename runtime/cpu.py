"""What an SPS table's speeds depend on besides the bundle: this machine's CPU, by the vector
instructions ONNX Runtime's kernels choose between and the cores its thread pool spreads over,
and whether other processes shared it while they were measured."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

# the ISA extensions that select MLAS kernels (GEMM, int8 GEMM, MatMulNBits) on x86 and Arm
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "sve", "i8mm", "bf16")


def cpu_signature() -> dict:
    """{"model": the CPU's name, "cores": usable cores, "flags": the ISA_FLAGS it has}."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and not model:
                model = value.strip()
            elif key in ("flags", "Features"):
                flags.update(value.split())
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"model": model or platform.processor() or platform.machine(), "cores": cores, "flags": [f for f in ISA_FLAGS if f in flags]}


def differs(measured: dict, here: dict) -> str | None:
    """How the CPU an SPS table was measured on differs from this one (None: it does not, in
    flags and cores)."""
    parts = []
    gone, new = set(measured.get("flags", ())) - set(here["flags"]), set(here["flags"]) - set(measured.get("flags", ()))
    if gone or new:
        parts.append("flags " + ", ".join([*(f"-{f}" for f in sorted(gone)), *(f"+{f}" for f in sorted(new))]))
    if measured.get("cores", here["cores"]) != here["cores"]:
        parts.append(f"{measured['cores']} cores, here {here['cores']}")
    return "; ".join(parts) or None


class CpuUse:
    """CPU seconds used by other processes over an interval: machine busy time (/proc/stat)
    minus this process's user+system time. A large value means the timings were disturbed."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # no /proc/stat there: nan
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError):
            return float("nan")
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        return float(sum(f[:8]) - idle)

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def other_share(self) -> float:
        wall = time.perf_counter() - self.t0
        other = max(0.0, (self._busy() - self.busy0) / self.hz - (self._own() - self.own0))
        return other / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0

    def report(self) -> dict:
        wall = time.perf_counter() - self.t0
        busy = (self._busy() - self.busy0) / self.hz
        own = self._own() - self.own0
        other = max(0.0, busy - own)
        cores = os.cpu_count() or 1
        return {"wall_s": wall, "machine_busy_cpu_s": busy, "this_process_cpu_s": own, "other_cpu_s": other,
                "other_share_of_capacity": other / (wall * cores) if wall > 0 else 0.0,
                "loadavg_end": os.getloadavg()}
