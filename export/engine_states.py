"""The target's states as the deployed engine computes them, for training a drafter.

A drafter learns from the target's context features (at `target_layer_ids`) and its final-normed
last hidden state (whose LM head gives the target's distribution). `train_data.TorchStates` takes
them from the torch model; `EngineStates` takes them from the bundle's ONNX Runtime target graph
(`target_ort.onnx`), the graph that serves: with a quantized bundle its int8 activations and
4-bit blocks are the arithmetic the drafter meets at inference (issue 24: trained against the
deployed target). One call prefills whole sequences into an empty cache of their length; the
graph already emits the features, and the final norm's output (`h_L`, every row) is added as an
output of a copy of the graph in memory, whose weights stay in the bundle's `weights.bin`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto as TP
from onnx import helper

from dspark.runtime.backends.onnxruntime import session_options
from dspark.runtime.errors import BundleError
from dspark.runtime.graph_io import PAST, PRESENT, kv_names
from dspark.runtime.manifest import Manifest

from .ort_graph import hidden_name

ROLE = "target_ort"


class EngineStates:
    """`train_data.StateSource` over a bundle's ONNX Runtime target graph (CPU provider)."""

    compute = "engine"

    def __init__(self, bundle: str | Path, threads: int | None = None):
        import onnxruntime as ort

        self.bundle = Path(bundle)
        self.manifest = Manifest.load(self.bundle)
        if ROLE not in self.manifest.graphs:
            raise BundleError(f"bundle {bundle} has no ONNX Runtime target graph ({ROLE}); re-run `dspark export`")
        self.manifest.check_files(self.bundle)
        c = self.manifest.target
        self.layer_ids = tuple(self.manifest.drafter.target_layer_ids)
        self.kv_heads, self.head_dim = c.num_kv_heads, c.head_dim
        self.past = kv_names(PAST, c.num_layers)
        self.final = hidden_name(c.num_layers)  # the final norm's output
        graph = onnx.load(str(self.bundle / self.manifest.graphs[ROLE]), load_external_data=False)
        if not any(self.final in n.output for n in graph.graph.node):
            raise BundleError(f"{bundle}/{self.manifest.graphs[ROLE]} has no tensor {self.final} (the final norm's "
                              "output): it was written by another exporter; re-run `dspark export`")
        graph.graph.output.append(helper.make_tensor_value_info(self.final, TP.FLOAT, ["rows", c.hidden_size]))
        so = session_options(threads)  # the weights it names are read from the bundle's folder
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(self.bundle))
        self.session = ort.InferenceSession(graph.SerializeToString(), so, providers=["CPUExecutionProvider"])

    def states(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] (right-padded; causal, so padding never reaches real rows) -> features
        [B, T, m·d] and final_hidden [B, T, d], fp32, as `train_data.target_states` returns them.
        Each layer's K/V rows go into a zero cache of T positions, bound as past and present at
        once (in place, as the runtime binds them)."""
        import onnxruntime as ort

        B, T = tokens.shape
        binding = self.session.io_binding()
        for name in ("features", self.final):
            binding.bind_output(name, "cpu")
        feeds = {"input_ids": tokens.cpu().numpy().astype(np.int64),
                 "logit_index": np.full((B, 1), T - 1, np.int64),  # one logit row: the states are the point
                 "starts": np.zeros(B, np.int64), "key_count": np.array([T], np.int64)}
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("logits", "cpu")
        for past in self.past:
            cache = ort.OrtValue.ortvalue_from_numpy(np.zeros((B, self.kv_heads, T, self.head_dim), np.float32))
            binding.bind_ortvalue_input(past, cache)  # [B, Hkv, T, D]
            binding.bind_ortvalue_output(past.replace(PAST, PRESENT, 1), cache)
        self.session.run_with_iobinding(binding)
        features, final = (v.numpy() for v in binding.get_outputs()[:2])
        return torch.from_numpy(features), torch.from_numpy(final).view(B, T, -1)

    def fingerprint(self) -> str:
        """The deployed target: its source, precision and feature layers."""
        m = self.manifest
        key = {"engine": m.source_hashes.get("target"), "precision": m.precision, "layers": list(self.layer_ids),
               "exporter": m.exporter_version}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
