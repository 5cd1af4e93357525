"""What the shared GPU layer needs from a device library (CuPy here, PyTorch on the export
side): static buffers, copies in and out, a row scatter into the KV caches that reads its
positions from device memory, and CUDA-graph capture. Arrays are the library's own; slicing one
along its first axis (`cache[lo:hi]`, a request slot range) gives a view of the same memory."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

Outputs = dict[str, Any]  # output name -> device array


class Device(Protocol):
    name: str  # e.g. "cuda:0 (NVIDIA H200)"

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A new zero-filled device array: a static buffer, never reallocated."""
        ...

    def upload(self, dst: Any, src: np.ndarray) -> None:
        """Copy host `src` into the static buffer `dst` (same shape), ordered before later launches."""
        ...

    def download(self, src: Any) -> np.ndarray:
        """A host copy of a device array (never a view: the next replay rewrites the array),
        taken after the work that writes it."""
        ...

    def write_rows(self, cache: Any, rows: Any, positions: Any) -> None:
        """cache [B, H, S_max, D][b, :, positions[b, s]] = rows [B, H, n, D][b, :, s] for s < n, enqueued
        on the stream; positions [B, >= n] stays on the device, so a captured graph replays it."""
        ...

    def compute(self, fn: Callable[..., Any], *args: Any) -> np.ndarray:
        """fn(xp, *args) with xp the device's array module (numpy or CuPy) and every argument as
        an xp array (device arrays as views, host arrays copied over), on the device's stream;
        the result comes back to the host. For small computations outside the graphs."""
        ...

    def capture(self, body: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        """Run `body` once as a warm-up, capture it as a CUDA graph; return (replay, the static
        outputs that every replay rewrites). Raises if the body cannot be captured."""
        ...


class PointerDevice(Device, Protocol):
    """A `Device` whose arrays a native engine reads by raw address on one CUDA stream
    (`CupyDevice`): what TensorRT's and ONNX Runtime's CUDA bindings take."""

    id: int  # the CUDA device ordinal
    info: Any  # cupy_device.GpuInfo: name and compute capability
    stream_handle: int  # the cudaStream_t every launch is ordered on

    def address(self, array: Any) -> int:
        ...
