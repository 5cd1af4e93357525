"""The PyTorch reference graphs (export/graphs.py: the computation the ONNX graphs hold) run
as steps of the shared GPU layer (dspark.runtime.backends.gpu), captured as CUDA graphs by PyTorch.

Export side: torch never becomes a runtime dependency. On a CUDA device this is the second
GPU backend next to TensorRT (ran on an H200 at batch 1, random weights; concurrent requests and
real weights UNTESTED on a GPU until scripts/gpu_check.sh runs them). On
the CPU, `TorchDevice.capture` records the body and re-runs it instead of capturing a graph,
which lets the CPU suite check everything on the GPU path but the capture itself."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from dspark.runtime.errors import BackendError
from dspark.runtime.backends.gpu.buckets import Buckets
from dspark.runtime.backends.gpu.device import Outputs
from dspark.runtime.backends.gpu.graph_backend import GraphBackend
from dspark.runtime.graph_io import DRAFTER_INPUTS, TARGET_INPUTS, drafter_outputs, target_outputs

from .drafter import Drafter
from .graphs import DrafterGraph, TargetGraph
from .target import TargetModel


class TorchDevice:
    """`dspark.runtime.backends.gpu.device.Device` over torch tensors on one device."""

    def __init__(self, device: str = "cuda", warmup: int = 2):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and not torch.cuda.is_available():
            raise BackendError(f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)")
        self.name = f"{self.device} ({torch.cuda.get_device_name(self.device)})" if self.is_cuda else str(self.device)
        self.warmup = warmup
        self._graphs: list[Any] = []  # keep every captured graph (and its memory pool) alive

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.from_numpy(np.zeros(0, dtype)).dtype, device=self.device)

    def upload(self, dst: torch.Tensor, src: np.ndarray) -> None:
        dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))  # on the current stream, before the next replay

    def download(self, src: torch.Tensor) -> np.ndarray:
        t = src.float() if src.dtype in (torch.float16, torch.bfloat16) else src
        return t.to("cpu", copy=True).numpy()  # a copy (the next replay rewrites `src`); waits for the stream

    def write_rows(self, cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
        B, _, n, _ = rows.shape
        slot = torch.arange(B, device=cache.device)[:, None].expand(B, n)  # [B, n]
        cache.transpose(1, 2)[slot, positions[:, :n]] = rows.transpose(1, 2)  # [B, n, H, D] at device positions

    def compute(self, fn: Callable[..., Any], *args: Any) -> np.ndarray:
        """numpy on the CPU; CuPy on CUDA (zero-copy through DLPack; both libraries use the
        device's default stream here, so the work is ordered after the graphs)."""
        if not self.is_cuda:
            return np.asarray(fn(np, *(a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a) for a in args)))
        import cupy

        views = (cupy.from_dlpack(a) if isinstance(a, torch.Tensor) else cupy.asarray(a) for a in args)
        return cupy.asnumpy(fn(cupy, *views))

    def capture(self, body: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        if not self.is_cuda:  # the CPU stand-in: replays re-run the body into the first outputs
            outputs = body()

            def rerun() -> None:
                for name, value in body().items():
                    outputs[name].copy_(value)

            return rerun, outputs
        side = torch.cuda.Stream(self.device)  # warm-up on a side stream, as torch.cuda.graph's docs ask
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a private memory pool per graph: outputs never alias another graph's
            outputs = body()
        self._graphs.append(graph)
        return graph.replay, outputs


class TorchStep:
    """One graph module as a `dspark.runtime.backends.gpu.graph_backend.Step`."""

    def __init__(self, module: nn.Module, input_names: tuple[str, ...], output_names: list[str]):
        self.module, self.input_names, self.output_names = module, input_names, output_names

    def prepare(self, inputs: dict[str, Any], kv: list[Any], graphed: bool) -> Callable[[], Outputs]:
        args = [inputs[name] for name in self.input_names] + list(kv)
        module, names = self.module, self.output_names

        def launch() -> Outputs:
            with torch.no_grad():
                return dict(zip(names, module(*args)))

        return launch


def cuda_graph_backend(target: TargetModel, drafter: Drafter | None, max_seq: int, device: str = "cuda",
                       graphs: bool = True, prefill_chunk: int = 512, min_context: int = 128,
                       device_acceptance: bool | None = None, slots: int = 1) -> GraphBackend:
    """A `Backend` running the target (and drafter) graph modules on `device` for `slots`
    concurrent requests, replaying CUDA graphs per (batch bucket, query length, context bucket)
    when `graphs` is on. The models are copied, not moved: the caller's modules stay where they
    are. device_acceptance (None: on the CPU, and on CUDA where CuPy is installed): the
    acceptance rule runs next to the logits."""
    dev = TorchDevice(device)
    if device_acceptance is None:
        device_acceptance = not dev.is_cuda or importlib.util.find_spec("cupy") is not None
    ids = drafter.cfg.target_layer_ids if drafter is not None else ()
    t = TargetGraph(target, ids).to(dev.device).eval()
    target_step = TorchStep(t, TARGET_INPUTS, target_outputs(target.cfg.num_layers))
    drafter_step = None
    if drafter is not None:
        drafter.cfg.check_against(target.cfg)
        d = DrafterGraph(drafter, branch="sampled").to(dev.device).eval()
        drafter_step = TorchStep(d, DRAFTER_INPUTS, drafter_outputs(drafter.cfg.num_layers))
    gamma = drafter.cfg.block_size if drafter is not None else 0
    buckets = Buckets(max_seq, gamma + 1, max(prefill_chunk, gamma + 1), min_context, slots)
    kv_dtype = np.dtype(np.float32) if target.embed_tokens.weight.dtype == torch.float32 else None
    if kv_dtype is None:
        raise BackendError(f"the CUDA-graph backend runs fp32 models; got {target.embed_tokens.weight.dtype}")
    return GraphBackend(dev, target.cfg, drafter.cfg if drafter is not None else None, target_step, drafter_step,
                        buckets, graphs, kv_dtype, device_acceptance)
