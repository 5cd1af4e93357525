"""`manifest.json`: what a bundle holds and how it was made. Validated on load."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import DrafterConfig, TargetConfig
from .errors import BundleError, ConfigError

BUNDLE_FORMAT = 4  # bumped whenever graphs or manifest change incompatibly (2: the drafter's ctx_mask input;
# 3: the ONNX Runtime target's row-invariant attention, inputs starts and key_count; 4: every graph's
# weights in one shared weights.bin, the portable target graph only on request)
EXPORTER_VERSION = "0.3.0"


@dataclass
class Manifest:
    name: str
    target: TargetConfig
    drafter: DrafterConfig
    graphs: dict[str, str]  # role -> file name in the bundle ("target", "drafter")
    tokenizer: str  # tokenizer.json
    chat_template: str | None
    special_tokens: dict[str, Any]  # bos/eos strings and ids, stop_token_ids
    dtype: str  # "float32"
    drafter_label: str  # where the drafter came from ("untrained: ...", a checkpoint path)
    source_hashes: dict[str, str]  # sha256 of the target and drafter source files
    files: dict[str, int] = field(default_factory=dict)  # file name -> size in bytes
    exporter_version: str = EXPORTER_VERSION
    bundle_format: int = BUNDLE_FORMAT
    extra: dict[str, Any] = field(default_factory=dict)  # SPS tables, calibration, engine metadata

    @property
    def precision(self) -> str:
        """The target's weights: fp32, or a quantized precision of `dspark export --precision`."""
        return self.extra.get("precision", {}).get("name", "fp32")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.special_tokens.get("stop_token_ids", ()))

    def to_json(self) -> str:
        d = asdict(self)
        d["target"] = self.target.to_dict()
        d["drafter"] = self.drafter.to_hf()
        return json.dumps(d, indent=2) + "\n"

    def save(self, directory: Path) -> None:
        """Atomically (a build that adds engines rewrites the manifest of a bundle in use)."""
        tmp = directory / ".manifest.json.tmp"
        tmp.write_text(self.to_json())
        os.replace(tmp, directory / "manifest.json")

    @classmethod
    def load(cls, directory: str | Path) -> "Manifest":
        directory = Path(directory)
        path = directory / "manifest.json"
        if not directory.is_dir():
            raise BundleError(f"bundle {directory} does not exist; build one with `dspark export --out {directory}`")
        if not path.exists():
            raise BundleError(f"{directory} has no manifest.json: not a bundle (or an interrupted export)")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BundleError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise BundleError(f"{path} holds a JSON {type(d).__name__}, not a manifest object; re-export the bundle")
        fmt = d.get("bundle_format")
        if fmt != BUNDLE_FORMAT:
            raise BundleError(f"{path}: bundle_format is {fmt!r} (exporter {d.get('exporter_version')!r}), this "
                              f"runtime reads format {BUNDLE_FORMAT} (exporter {EXPORTER_VERSION}); re-export it: "
                              f"`dspark export --out {directory}` (with the --target, --drafter and --precision it "
                              f"was made with)")
        try:
            m = cls(**{**d, "target": TargetConfig.from_dict(d["target"]),
                       "drafter": DrafterConfig.from_hf(d["drafter"])})
            m.drafter.check_against(m.target)
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as e:
            raise BundleError(f"{path} is malformed: {e}") from e
        m.check_files(directory)
        return m

    def check_files(self, directory: Path) -> None:
        for name in [*self.graphs.values(), self.tokenizer, *self.files]:
            if Path(name).name != name:
                raise BundleError(f"{directory}/manifest.json names {name!r}: bundle files must be plain names "
                                  f"inside the bundle")
        for name in [*self.graphs.values(), self.tokenizer]:
            if not (directory / name).exists():
                raise BundleError(f"bundle {directory} is missing {name}; re-run `dspark export`")
        for name, size in self.files.items():
            p = directory / name
            if not p.exists():
                raise BundleError(f"bundle {directory} is missing {name}; re-run `dspark export`")
            if p.stat().st_size != size:
                raise BundleError(f"bundle file {p} has {p.stat().st_size} bytes, the manifest says {size}: "
                                  f"corrupt or from another export")
