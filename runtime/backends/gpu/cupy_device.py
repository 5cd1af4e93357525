"""CuPy as the shared layer's `Device`: static buffers as CuPy arrays (raw pointers for
TensorRT), one non-blocking stream, graph capture on that stream. Imported only when a
device is opened. UNTESTED: no GPU in this project's development environment."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import BackendError
from .device import Outputs

# cache [B, H, S_max, D][b, h, positions[b, s], d] = rows [B, H, n, D][b, h, s, d]; one thread per element
_WRITE_ROWS = """
const long long d = i % dim;
const long long s = (i / dim) % n;
const long long bh = i / (dim * n);
const long long b = bh / heads;
cache[(bh * max_seq + positions[b * pos_stride + s]) * dim + d] = rows[i];
"""


def import_cupy():
    try:
        import cupy
    except ImportError as e:
        raise BackendError("CuPy is not installed (pip install cupy-cuda13x, or cupy-cuda12x for CUDA 12): the "
                           "GPU backends keep their buffers in CuPy arrays") from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 — CuPy raises its own CUDA error types when no driver/device
        raise BackendError(f"no usable CUDA device: {e}") from e
    if count == 0:
        raise BackendError("no CUDA device is visible")
    return cupy


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute: tuple[int, int]  # compute capability (major, minor)


def gpu_info() -> GpuInfo:
    cp = import_cupy()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    return GpuInfo(name.decode() if isinstance(name, bytes) else str(name), (int(props["major"]), int(props["minor"])))


class CupyDevice:
    """`backends.gpu.device.Device` on the current CUDA device."""

    def __init__(self):
        self.cp = cp = import_cupy()
        self.id = cp.cuda.Device().id
        self.info = gpu_info()
        self.name = f"cuda:{self.id} ({self.info.name})"
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._write = cp.ElementwiseKernel(
            "raw T rows, raw int64 positions, int64 heads, int64 n, int64 max_seq, int64 dim, int64 pos_stride",
            "raw T cache", _WRITE_ROWS, "dspark_write_rows")
        self._graphs: list[Any] = []  # keep every captured graph alive

    @property
    def stream_handle(self) -> int:
        return self.stream.ptr

    def address(self, array: Any) -> int:
        return array.data.ptr

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        with self.stream:
            return self.cp.zeros(shape, dtype)

    def upload(self, dst: Any, src: np.ndarray) -> None:
        dst.set(np.ascontiguousarray(src, dst.dtype), stream=self.stream)

    def download(self, src: Any) -> np.ndarray:
        return src.get(stream=self.stream)  # a new host array, after the stream's work

    def write_rows(self, cache: Any, rows: Any, positions: Any) -> None:
        B, H, n, D = rows.shape
        with self.stream:
            self._write(rows, positions, H, n, cache.shape[2], D, positions.shape[1], cache, size=rows.size)

    def compute(self, fn: Callable[..., Any], *args: Any) -> np.ndarray:
        cp = self.cp
        with self.stream:
            return fn(cp, *(a if isinstance(a, cp.ndarray) else cp.asarray(a) for a in args)).get(stream=self.stream)

    def capture(self, body: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        """One warm-up run (TensorRT wants an enqueue after every shape change before a capture),
        then capture on the stream."""
        with self.stream:
            body()
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                outputs = body()
            finally:
                graph = self.stream.end_capture()
        self._graphs.append(graph)
        return (lambda: graph.launch(self.stream)), outputs
