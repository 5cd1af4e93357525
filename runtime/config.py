"""Model configurations as plain dataclasses, parsed from Hugging Face style dicts.

The runtime and the exporter share these; nothing here imports torch."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ConfigError

TARGET_ARCHS = {"llama": "llama", "qwen3": "qwen3"}
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def _rope_theta(cfg: dict[str, Any]) -> float:
    """RoPE base from `rope_parameters` (recent transformers) or `rope_theta` (older)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"rope_type is {rope_type!r}; only 'default' RoPE is supported")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ConfigError("config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


def _require(cfg: dict[str, Any], key: str, what: str) -> Any:
    if key not in cfg:
        raise ConfigError(f"{what}: config.json has no field {key!r}")
    return cfg[key]


def _layer_dims(cfg: dict[str, Any], what: str) -> dict[str, Any]:
    """The transformer dimensions both configs share, from a Hugging Face config dict."""
    heads = int(_require(cfg, "num_attention_heads", what))
    hidden = int(_require(cfg, "hidden_size", what))
    return dict(
        vocab_size=int(_require(cfg, "vocab_size", what)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", what)),
        num_layers=int(_require(cfg, "num_hidden_layers", what)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=_rope_theta(cfg),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )


@dataclass(frozen=True)
class TargetConfig:
    """A decoder-only target: Llama family or Qwen3 family (per-head q/k RMSNorm)."""

    arch: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "TargetConfig":
        what = "target config"
        model_type = _require(cfg, "model_type", what)
        if model_type not in TARGET_ARCHS:
            raise ConfigError(f"{what}: model_type is {model_type!r}, expected one of {sorted(TARGET_ARCHS)}")
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ConfigError(f"{what}: {flag} is true; biased projections are not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            arch=TARGET_ARCHS[model_type],
            **_layer_dims(cfg, what),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TargetConfig":
        return cls(**{**d, "eos_token_ids": tuple(d.get("eos_token_ids", ()))})


@dataclass(frozen=True)
class DrafterConfig:
    """A DSpark (or DFlash) drafter in the DeepSpec checkpoint format (dspark.md §7)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    num_target_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int = 0
    markov_head_type: str | None = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    # The whole config.json, kept so that a checkpoint round-trips unchanged.
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "DrafterConfig":
        what = "drafter config"
        rank = int(cfg.get("markov_rank", 0) or 0)
        head_type = cfg.get("markov_head_type") if rank > 0 else None
        if rank > 0 and head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(
                f"{what}: markov_head_type is {head_type!r}, expected one of {list(MARKOV_HEAD_TYPES)}"
            )
        conf = bool(cfg.get("enable_confidence_head", False))
        with_markov = bool(cfg.get("confidence_head_with_markov", False)) if conf else False
        if with_markov and rank == 0:
            raise ConfigError(f"{what}: confidence_head_with_markov is true but markov_rank is 0")
        ids = tuple(int(i) for i in _require(cfg, "target_layer_ids", what))
        n_target = int(_require(cfg, "num_target_layers", what))
        c = cls(
            **_layer_dims(cfg, what),
            num_target_layers=n_target,
            block_size=int(_require(cfg, "block_size", what)),
            target_layer_ids=ids,
            mask_token_id=int(_require(cfg, "mask_token_id", what)),
            markov_rank=rank,
            markov_head_type=head_type,
            enable_confidence_head=conf,
            confidence_head_with_markov=with_markov,
            raw=dict(cfg),
        )
        c.validate_layer_ids(n_target)
        if c.block_size < 1:
            raise ConfigError(f"{what}: block_size is {c.block_size}, expected >= 1")
        if not 0 <= c.mask_token_id < c.vocab_size:
            raise ConfigError(f"{what}: mask_token_id is {c.mask_token_id}, expected in [0, {c.vocab_size})")
        return c

    def validate_layer_ids(self, num_target_layers: int) -> None:
        ids = self.target_layer_ids
        if not ids:
            raise ConfigError("drafter config: target_layer_ids is empty")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ConfigError(f"drafter config: target_layer_ids is {list(ids)}, expected strictly increasing")
        if ids[0] < -1 or ids[-1] >= num_target_layers - 1:
            raise ConfigError(
                f"drafter config: target_layer_ids is {list(ids)}, expected ids in [-1, {num_target_layers - 2}] "
                f"(the target has {num_target_layers} layers and its last layer may not be used)"
            )

    def check_against(self, target: TargetConfig) -> None:
        """Raise one clear error if this drafter cannot serve `target`."""
        for name, mine, theirs in (
            ("vocab_size", self.vocab_size, target.vocab_size),
            ("hidden_size", self.hidden_size, target.hidden_size),
            ("num_target_layers", self.num_target_layers, target.num_layers),
        ):
            if mine != theirs:
                raise ConfigError(f"drafter {name} is {mine} but the target's is {theirs}")
        self.validate_layer_ids(target.num_layers)

    @property
    def feature_dim(self) -> int:
        """Width of the raw context features: len(target_layer_ids) * hidden_size."""
        return len(self.target_layer_ids) * self.hidden_size

    def to_hf(self) -> dict[str, Any]:
        """config.json contents (the raw dict, with our fields written over it)."""
        out = dict(self.raw)
        out.update(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            target_layer_ids=list(self.target_layer_ids),
            mask_token_id=self.mask_token_id,
            markov_rank=self.markov_rank,
            enable_confidence_head=self.enable_confidence_head,
            tie_word_embeddings=False,
        )
        out.setdefault("architectures", ["Qwen3DSparkModel" if self.markov_rank else "Qwen3DFlashModel"])
        out.setdefault("layer_types", ["full_attention"] * self.num_layers)
        if "rope_parameters" not in out and "rope_theta" not in out:
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.markov_rank:
            out["markov_head_type"] = self.markov_head_type
        else:
            out.pop("markov_head_type", None)
        if self.enable_confidence_head:
            out["confidence_head_with_markov"] = self.confidence_head_with_markov
        else:
            out.pop("confidence_head_with_markov", None)
        return out
