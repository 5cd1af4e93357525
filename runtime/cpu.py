"""What an SPS table's speeds depend on besides the bundle: this machine's CPU, by the vector
instructions ONNX Runtime's kernels choose between and the cores its thread pool spreads over."""
from __future__ import annotations

import os
import platform
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
