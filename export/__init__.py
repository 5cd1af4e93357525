"""dspark.export: PyTorch reference models, checkpoint loaders and exporters (heavy side)."""
from .checkpoint import load_drafter, save_drafter
from .drafter import Drafter, DraftResult, DraftSession
from .target import StaticKV, TargetModel
from .target_loader import LoadedTarget, default_target_path, load_target
from .torch_backend import TorchBackend

__all__ = ["load_drafter", "save_drafter", "Drafter", "DraftResult", "DraftSession", "StaticKV", "TargetModel",
           "LoadedTarget", "default_target_path", "load_target", "TorchBackend"]
