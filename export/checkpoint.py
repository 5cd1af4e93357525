"""DeepSpec checkpoint format (dspark.md §7): read and write drafters.

A checkpoint is a directory with `config.json` and `model.safetensors` (or shards with
`model.safetensors.index.json`). The frozen embedding and LM head may be left out and
restored from the target; everything else must be present with the right shape."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark.runtime.config import DrafterConfig
from dspark.runtime.errors import CheckpointError

from .drafter import Drafter

SHARED = ("embed_tokens.weight", "lm_head.weight")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards its index names."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.exists():
            raise CheckpointError(f"{directory}: the index names shard {name}, which is missing")
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(f"{directory}: no config.json")
    return json.loads(path.read_text())


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32,
                 embeddings: tuple[torch.Tensor, torch.Tensor] | None = None) -> Drafter:
    """Build a `Drafter` from a DeepSpec (or DeepSpec-trained DFlash) checkpoint.

    `embeddings` = (embed_tokens.weight, lm_head.weight) of the target, used when the
    checkpoint leaves them out. Raises `CheckpointError` naming the first bad weight;
    nothing is returned half-loaded."""
    directory = Path(path)
    cfg = DrafterConfig.from_hf(read_config(directory))
    weights = {k.removeprefix("model."): v for k, v in read_safetensors(directory).items()
               if not k.endswith(IGNORED_SUFFIXES)}
    for key, tensor in zip(SHARED, embeddings or ()):
        weights.setdefault(key, tensor)
    drafter = Drafter(cfg)
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    for key, shape in expected.items():
        if key not in weights:
            hint = " (pass the target's embeddings to restore it)" if key in SHARED else ""
            raise CheckpointError(f"{directory}: weight {key} is missing{hint}")
        if tuple(weights[key].shape) != shape:
            raise CheckpointError(f"{directory}: weight {key} has shape {tuple(weights[key].shape)}, expected {shape}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise CheckpointError(f"{directory}: unexpected weights {unexpected[:5]} for this config")
    drafter.load_state_dict({k: weights[k] for k in expected})
    return drafter.to(dtype).eval()


def save_drafter(drafter: Drafter, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                 include_embeddings: bool = True) -> None:
    """Write `config.json` + `model.safetensors` (bf16 by default, as DeepSpec does)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items()
             if include_embeddings or k not in SHARED}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(drafter.cfg.to_hf(), indent=2) + "\n")
