"""dspark.export: PyTorch reference models, checkpoint loaders and exporters (heavy side).

Names are imported on first use, so that `import dspark.export.graphs` (say, on a GPU machine
without safetensors or transformers) loads only what it needs."""
import importlib

_SOURCES = {
    "load_drafter": "checkpoint", "save_drafter": "checkpoint",
    "Drafter": "drafter", "DraftResult": "drafter", "DraftSession": "drafter",
    "StaticKV": "target", "TargetModel": "target",
    "LoadedTarget": "target_loader", "default_target_path": "target_loader", "load_target": "target_loader",
    "TorchBackend": "torch_backend",
}
__all__ = list(_SOURCES)


def __getattr__(name: str):
    if name in _SOURCES:
        return getattr(importlib.import_module(f".{_SOURCES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
