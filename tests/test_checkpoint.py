"""DeepSpec-format drafter checkpoints (dspark.md §7), the drafter's round semantics
(§2) and its sequential and confidence heads (§3–4), checked against formulas written
here with plain torch ops."""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from factories import hf_drafter_config, hf_target_config, tiny_drafter, tiny_target
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspark.export import DraftSession, TorchBackend, load_drafter, save_drafter
from dspark.export.drafter import Drafter
from dspark.runtime.config import DrafterConfig
from dspark.runtime.errors import CheckpointError, ConfigError, InputError

HEADS = {
    "vanilla": dict(markov_rank=8, head="vanilla"),
    "gated": dict(markov_rank=8, head="gated"),
    "rnn": dict(markov_rank=8, head="rnn"),
    "dflash": dict(markov_rank=0, confidence=False),
}
SHARED = ("embed_tokens.weight", "lm_head.weight")
PROMPT = [5, 6, 7, 8, 11, 3, 42, 42, 9]  # n = 9
N = len(PROMPT)
ACCEPTED = 2  # drafts accepted in round 1; round 2 gets a + 1 = 3 new context rows


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=0)


def _sequence(target) -> list[int]:
    """The prompt and a few more tokens: x[N] is round 1's anchor, x[N + a + 1] round 2's."""
    return PROMPT + [17, 60, 23, 70, 31, 12]


def _features(target, tokens: list[int], layer_ids) -> np.ndarray:
    """Raw context features [len(tokens), m*d] of the target (one full forward)."""
    with torch.no_grad():
        _, feats = target.new_cache(1, len(tokens)).run(target, torch.tensor([tokens]), 0, tuple(layer_ids))
    return feats[0].numpy()


def _two_rounds(drafter: Drafter, target, temperature: float = 0.0, seed: int = 0):
    """Round 1 over the prompt (start = N), round 2 over the a + 1 verified rows."""
    seq = _sequence(target)
    feats = _features(target, seq, drafter.cfg.target_layer_ids)
    rng = np.random.default_rng(seed)
    gamma = drafter.cfg.block_size
    s = DraftSession(drafter, max_len=64)
    r1 = s.draft(feats[:N], seq[N], N, temperature, uniforms=rng.random(gamma))
    start2 = N + ACCEPTED + 1
    r2 = s.draft(feats[N:start2], seq[start2], start2, temperature, uniforms=rng.random(gamma))
    return r1, r2


def _assert_results_equal(a, b, atol: float = 0.0):
    for field in ("base_logits", "logits", "probs", "confidence_logits"):
        x, y = getattr(a, field), getattr(b, field)
        if atol == 0.0:
            assert np.array_equal(x, y), field
        else:
            np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=field)
    assert np.array_equal(a.tokens, b.tokens)


def _state_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def _embeddings(target):
    return (target.embed_tokens.weight, target.lm_head.weight)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("with_embeddings", [True, False], ids=["embeddings", "no_embeddings"])
@pytest.mark.parametrize("head", list(HEADS))
def test_fp32_round_trip_is_exact(target, head, with_embeddings, tmp_path):
    drafter = tiny_drafter(target, **HEADS[head])
    save_drafter(drafter, tmp_path, dtype=torch.float32, include_embeddings=with_embeddings)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F32"}
    assert (SHARED[0] in keys) == with_embeddings and (SHARED[1] in keys) == with_embeddings

    if not with_embeddings:
        with pytest.raises(CheckpointError, match="embed_tokens.weight"):
            load_drafter(tmp_path)
    loaded = load_drafter(tmp_path, embeddings=None if with_embeddings else _embeddings(target))
    assert loaded.cfg == drafter.cfg
    _state_equal(loaded.state_dict(), drafter.state_dict())
    for ours, theirs in zip(_two_rounds(loaded, target), _two_rounds(drafter, target)):
        _assert_results_equal(ours, theirs)
    for ours, theirs in zip(_two_rounds(loaded, target, 0.8), _two_rounds(drafter, target, 0.8)):
        _assert_results_equal(ours, theirs)


@pytest.mark.parametrize("with_embeddings", [True, False], ids=["embeddings", "no_embeddings"])
@pytest.mark.parametrize("head", list(HEADS))
def test_bf16_round_trip_equals_rounded_original(target, head, with_embeddings, tmp_path):
    drafter = tiny_drafter(target, **HEADS[head])
    save_drafter(drafter, tmp_path, include_embeddings=with_embeddings)  # bf16 by default
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    emb = None if with_embeddings else _embeddings(target)

    rounded = copy.deepcopy(drafter)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if with_embeddings or name not in SHARED:  # restored embeddings come from the fp32 target
                p.copy_(p.to(torch.bfloat16).float())
    assert any(not torch.equal(a, b) for a, b in zip(rounded.state_dict().values(),
                                                     drafter.state_dict().values())), "bf16 should round"

    loaded = load_drafter(tmp_path, embeddings=emb)  # fp32
    _state_equal(loaded.state_dict(), rounded.state_dict())
    for ours, theirs in zip(_two_rounds(loaded, target), _two_rounds(rounded, target)):
        _assert_results_equal(ours, theirs)

    loaded_bf16 = load_drafter(tmp_path, dtype=torch.bfloat16, embeddings=emb)
    _state_equal(loaded_bf16.state_dict(), {k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items()})
    r1, r2 = _two_rounds(loaded_bf16, target)  # runs in bf16 and returns fp32 numpy
    assert r1.logits.dtype == np.float32 and np.isfinite(r2.logits).all()


@pytest.mark.parametrize("head", list(HEADS))
def test_config_json_fields(target, head, tmp_path):
    drafter = tiny_drafter(target, **HEADS[head])
    save_drafter(drafter, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("architectures", "num_hidden_layers", "num_target_layers", "block_size", "target_layer_ids",
                "mask_token_id", "num_anchors", "markov_rank", "enable_confidence_head", "layer_types"):
        assert key in cfg, key
    assert cfg["tie_word_embeddings"] is False
    assert cfg["layer_types"] == ["full_attention"] * cfg["num_hidden_layers"]
    assert "rope_parameters" in cfg or "rope_theta" in cfg
    assert cfg["num_target_layers"] == target.cfg.num_layers
    assert cfg["target_layer_ids"] == [-1, 1, 2]
    if head == "dflash":
        assert cfg["markov_rank"] == 0 and cfg["enable_confidence_head"] is False
        assert "markov_head_type" not in cfg
        assert "confidence_head_with_markov" not in cfg
        assert drafter.markov_head is None and drafter.confidence_head is None
    else:
        assert cfg["markov_head_type"] == head
        assert cfg["confidence_head_with_markov"] is True
    assert DrafterConfig.from_hf(cfg) == drafter.cfg


def test_older_rope_theta_field_is_accepted(target, tmp_path):
    drafter = tiny_drafter(target)
    save_drafter(drafter, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 10000.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_drafter(tmp_path).cfg.rope_theta == 10000.0


@pytest.mark.parametrize("prefix", ["", "model."], ids=["plain", "model_prefix"])
def test_sharded_checkpoint_loads(target, prefix, tmp_path):
    drafter = tiny_drafter(target, head="rnn")
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for fname, names in halves.items():
        save_file({prefix + k: state[k] for k in names}, str(tmp_path / fname), metadata={"format": "pt"})
        weight_map.update({prefix + k: fname for k in names})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(drafter.cfg.to_hf()))
    assert not (tmp_path / "model.safetensors").exists()

    loaded = load_drafter(tmp_path, dtype=torch.bfloat16)
    _state_equal(loaded.state_dict(), state)

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_drafter(tmp_path)


# --------------------------------------------------------------------------- bad input


def _drafter_cfg(**target_kw) -> DrafterConfig:
    return DrafterConfig.from_hf(hf_drafter_config(hf_target_config("llama", **target_kw)))


@pytest.mark.parametrize("field, target_kw, mine, theirs", [
    ("vocab_size", dict(vocab=101), 101, 97),
    ("hidden_size", dict(hidden=48), 48, 64),
    ("num_target_layers", dict(layers=6), 6, 4),
])
def test_drafter_target_mismatch(target, field, target_kw, mine, theirs):
    cfg = _drafter_cfg(**target_kw)
    with pytest.raises(ConfigError) as info:
        cfg.check_against(target.cfg)
    msg = str(info.value)
    assert field in msg and str(mine) in msg and str(theirs) in msg, msg
    with pytest.raises(ConfigError) as info2:
        TorchBackend(target, Drafter(cfg))
    assert str(info2.value) == msg


@pytest.mark.parametrize("ids, needles", [
    ((-1, 1, 7), ["[-1, 1, 7]", "[-1, 2]", "4 layers"]),  # out of range
    ((-2, 0), ["[-2, 0]", "[-1, 2]"]),
    ((0, 3), ["[0, 3]", "last layer", "[-1, 2]"]),  # the last layer (3 of 0..3) is not allowed
    ((1, 1), ["[1, 1]", "strictly increasing"]),
    ((2, 0), ["[2, 0]", "strictly increasing"]),
])
def test_bad_target_layer_ids(target, ids, needles, tmp_path):
    hf = hf_drafter_config(hf_target_config("llama"), layer_ids=ids)
    with pytest.raises(ConfigError) as info:
        DrafterConfig.from_hf(hf)
    for needle in needles + ["target_layer_ids"]:
        assert needle in str(info.value), str(info.value)
    # the same error surfaces when loading a checkpoint with that config
    save_drafter(tiny_drafter(target), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["target_layer_ids"] = list(ids)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        load_drafter(tmp_path)


def test_layer_ids_valid_for_drafter_but_not_target(target):
    """A drafter made for a deeper target fails check_against on the layer count."""
    cfg = DrafterConfig.from_hf(hf_drafter_config(hf_target_config("llama", layers=8), layer_ids=(1, 5)))
    with pytest.raises(ConfigError, match="num_target_layers is 8 but the target's is 4"):
        cfg.check_against(target.cfg)


def _rewrite_weights(directory, edit) -> None:
    state = load_file(str(directory / "model.safetensors"))
    edit(state)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_missing_weight(target, tmp_path):
    save_drafter(tiny_drafter(target), tmp_path)
    _rewrite_weights(tmp_path, lambda st: st.pop("layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"weight layers\.1\.mlp\.up_proj\.weight is missing"):
        load_drafter(tmp_path)


def test_missing_markov_weight(target, tmp_path):
    save_drafter(tiny_drafter(target, head="rnn"), tmp_path)
    _rewrite_weights(tmp_path, lambda st: st.pop("markov_head.joint_proj.bias"))
    with pytest.raises(CheckpointError, match=r"markov_head\.joint_proj\.bias is missing"):
        load_drafter(tmp_path)


def test_misshapen_weight(target, tmp_path):
    save_drafter(tiny_drafter(target), tmp_path)
    _rewrite_weights(tmp_path, lambda st: st.update({"fc.weight": torch.zeros(64, 100, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError) as info:
        load_drafter(tmp_path)
    msg = str(info.value)
    assert "fc.weight" in msg and "(64, 100)" in msg and "(64, 192)" in msg, msg


def test_unexpected_weights(target, tmp_path):
    """A gated checkpoint whose config says vanilla: the extra gate weights are named."""
    save_drafter(tiny_drafter(target, head="gated"), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["markov_head_type"] = "vanilla"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="markov_head.gate_proj"):
        load_drafter(tmp_path)


def test_unknown_markov_head_type(target, tmp_path):
    save_drafter(tiny_drafter(target), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["markov_head_type"] = "lstm"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_drafter(tmp_path)
    msg = str(info.value)
    assert "markov_head_type" in msg and "'lstm'" in msg and "vanilla" in msg and "rnn" in msg, msg


def test_missing_files(target, tmp_path):
    save_drafter(tiny_drafter(target), tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_drafter(tmp_path)
    save_drafter(tiny_drafter(target), tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_drafter(tmp_path / "b")


def test_missing_config_field(target, tmp_path):
    save_drafter(tiny_drafter(target), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["block_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="'block_size'"):
        load_drafter(tmp_path)


# --------------------------------------------------------------------------- round semantics


@pytest.mark.parametrize("head", list(HEADS))
def test_round_semantics_and_cache_equivalence(target, head):
    drafter = tiny_drafter(target, **HEADS[head])
    gamma = drafter.cfg.block_size
    seq = _sequence(target)
    feats = _features(target, seq, drafter.cfg.target_layer_ids)
    start2 = N + ACCEPTED + 1

    s = DraftSession(drafter, max_len=32)
    with pytest.raises(InputError, match="expected start - cache_len"):
        s.draft(feats[: N - 1], seq[N], N)  # round 1 needs the whole prompt
    r1 = s.draft(feats[:N], seq[N], N)
    assert s.cache_len == N
    with pytest.raises(InputError):
        s.draft(feats[N:start2 - 1], seq[start2], start2)  # a rows instead of a + 1
    with pytest.raises(InputError):
        s.draft(feats[N:start2 + 1], seq[start2], start2)
    assert s.cache_len == N  # a rejected call changes nothing
    r2 = s.draft(feats[N:start2], seq[start2], start2)
    assert s.cache_len == start2

    fresh = DraftSession(drafter, max_len=32)
    _assert_results_equal(r2, fresh.draft(feats[:start2], seq[start2], start2), atol=1e-5)
    _assert_results_equal(r1, DraftSession(drafter, max_len=32).draft(feats[:N], seq[N], N), atol=1e-5)

    # the independent reference of §2 agrees with both rounds
    for r, start in ((r1, N), (r2, start2)):
        h = _reference_block_states(drafter, torch.from_numpy(feats[:start]), seq[start], start)
        np.testing.assert_allclose(r.base_logits, (h @ drafter.lm_head.weight.detach().T).numpy(), rtol=0, atol=1e-5)

    # moving the length pointer back (a rejection) and feeding other rows = from scratch
    s.cache_len = N
    r3 = s.draft(feats[N:N + 1], seq[N + 1], N + 1)
    _assert_results_equal(r3, DraftSession(drafter, max_len=32).draft(feats[:N + 1], seq[N + 1], N + 1), atol=1e-5)

    with pytest.raises(InputError, match="max_len"):
        DraftSession(drafter, max_len=N + gamma - 1).draft(feats[:N], seq[N], N)
    with pytest.raises(InputError, match="temperature"):
        DraftSession(drafter).draft(feats[:N], seq[N], N, temperature=-0.5)
    with pytest.raises(InputError, match="uniforms"):
        DraftSession(drafter).draft(feats[:N], seq[N], N, temperature=1.0)


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("head", list(HEADS))
def test_sampling_with_uniforms_and_forced_replay(target, head):
    drafter = tiny_drafter(target, **HEADS[head])
    gamma, V = drafter.cfg.block_size, drafter.cfg.vocab_size
    seq = _sequence(target)
    feats = _features(target, seq, drafter.cfg.target_layer_ids)
    T = 1.5
    off_argmax = 0
    for seed in range(4):
        u = np.random.default_rng(seed).random(gamma)
        r = DraftSession(drafter).draft(feats[:N], seq[N], N, T, uniforms=u)
        # p_d = softmax((U + B) / T)
        z = r.logits.astype(np.float64) / T
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(r.probs, p, rtol=0, atol=1e-6)
        # tokens are the inverse-CDF draws: the first index whose cumulative mass exceeds u
        for k in range(gamma):
            cdf = np.cumsum(r.probs[k].astype(np.float64))
            x, tok = u[k] * cdf[-1], int(r.tokens[k])
            assert cdf[tok] > x - 1e-6 and (tok == 0 or cdf[tok - 1] <= x + 1e-6), (k, tok, u[k])
            off_argmax += tok != int(r.logits[k].argmax())
        # replaying the sampled tokens as forced tokens gives the same distributions
        replay = DraftSession(drafter).draft(feats[:N], seq[N], N, T, forced_tokens=r.tokens)
        _assert_results_equal(replay, r, atol=1e-6)
        # forcing other tokens: slot 1 is unchanged; later slots follow the forced previous tokens
        other = (r.tokens + 1) % V
        alt = DraftSession(drafter).draft(feats[:N], seq[N], N, T, forced_tokens=other)
        assert np.array_equal(alt.tokens, other)
        np.testing.assert_allclose(alt.probs[0], r.probs[0], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(alt.base_logits, r.base_logits)
        if drafter.markov_head is not None:
            assert np.abs(alt.logits[1:] - r.logits[1:]).max() > 1e-4
        else:
            np.testing.assert_allclose(alt.logits, r.logits, rtol=0, atol=1e-6)
    assert off_argmax > 0, "at T = 1.5 some draws should differ from the argmax"


@pytest.mark.parametrize("head", list(HEADS))
def test_greedy_is_argmax_with_one_hot_probs(target, head):
    drafter = tiny_drafter(target, **HEADS[head])
    seq = _sequence(target)
    feats = _features(target, seq, drafter.cfg.target_layer_ids)
    r = DraftSession(drafter).draft(feats[:N], seq[N], N, 0.0)
    assert np.array_equal(r.tokens, r.logits.argmax(-1))
    assert np.array_equal(r.probs, np.eye(drafter.cfg.vocab_size, dtype=np.float32)[r.tokens])
    # the uniforms are ignored at T = 0
    r2 = DraftSession(drafter).draft(feats[:N], seq[N], N, 0.0, uniforms=np.full(drafter.cfg.block_size, 0.3))
    _assert_results_equal(r, r2)
    if drafter.confidence_head is None:
        assert not r.confidence_logits.any()


# --------------------------------------------------------------------------- formulas (§2–4)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [S, H, D] at absolute positions pos [S]; rotate-half convention."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv[None]  # [S, D/2]
    cos, sin = torch.cos(ang).float()[:, None], torch.sin(ang).float()[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.no_grad()
def _reference_block_states(drafter: Drafter, feats: torch.Tensor, anchor: int, start: int) -> torch.Tensor:
    """h [γ, d] from dspark.md §2 with plain ops, all context rows at once (no cache)."""
    c = drafter.cfg
    H, Hkv, D, eps, gamma = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.block_size
    ctx = _rms(feats @ drafter.fc.weight.T, drafter.hidden_norm.weight, eps)  # [n, d]
    block = torch.tensor([anchor] + [c.mask_token_id] * (gamma - 1))
    x = drafter.embed_tokens.weight[block]
    ctx_pos, blk_pos = torch.arange(start), torch.arange(start, start + gamma)
    for layer in drafter.layers:
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, eps)  # block rows only

        def keys(src, pos):
            k = _rms((src @ a.k_proj.weight.T).view(-1, Hkv, D), a.k_norm.weight, eps)
            return _rope(k, pos, c.rope_theta), (src @ a.v_proj.weight.T).view(-1, Hkv, D)

        q = _rope(_rms((h @ a.q_proj.weight.T).view(gamma, H, D), a.q_norm.weight, eps), blk_pos, c.rope_theta)
        kc, vc = keys(ctx, ctx_pos)  # context rows skip input_layernorm
        kb, vb = keys(h, blk_pos)
        k, v = torch.cat([kc, kb]), torch.cat([vc, vb])  # [start + γ, Hkv, D]
        out = torch.empty(gamma, H, D)
        for head in range(H):
            kv = head // (H // Hkv)
            w = torch.softmax(q[:, head] @ k[:, kv].T / math.sqrt(D), dim=-1)  # no mask: bidirectional
            out[:, head] = w @ v[:, kv]
        x = x + out.reshape(gamma, H * D) @ a.o_proj.weight.T
        m = layer.mlp
        y = _rms(x, layer.post_attention_layernorm.weight, eps)
        x = x + (torch.nn.functional.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return _rms(x, drafter.norm.weight, eps)


@pytest.mark.parametrize("head, with_markov", [("vanilla", True), ("gated", True), ("rnn", True),
                                                ("vanilla", False), ("rnn", False)])
def test_heads_match_formulas(target, head, with_markov):
    drafter = tiny_drafter(target, markov_rank=8, head=head, with_markov=with_markov)
    c = drafter.cfg
    seq = _sequence(target)
    feats = _features(target, seq, c.target_layer_ids)
    u = np.random.default_rng(3).random(c.block_size)
    r = DraftSession(drafter).draft(feats[:N], seq[N], N, 1.0, uniforms=u)

    h = _reference_block_states(drafter, torch.from_numpy(feats[:N]), seq[N], N)  # [γ, d]
    np.testing.assert_allclose(r.base_logits, (h @ drafter.lm_head.weight.detach().T).numpy(), rtol=0, atol=1e-5)

    mh = drafter.markov_head
    W1, W2 = mh.markov_w1.weight, mh.markov_w2.weight  # [V, r] both
    r_ = c.markov_rank
    prevs = [seq[N]] + [int(t) for t in r.tokens[:-1]]  # the anchor precedes slot 1
    s = torch.zeros(r_)
    with torch.no_grad():
        for k, prev in enumerate(prevs):
            e = W1[prev]
            if head == "vanilla":
                B = W2 @ e
            elif head == "gated":
                g = torch.sigmoid(mh.gate_proj.weight @ torch.cat([h[k], e]) + mh.gate_proj.bias)
                B = W2 @ (g * e)
            else:
                y = mh.joint_proj.weight @ torch.cat([s, e, h[k]]) + mh.joint_proj.bias
                gate, cand, out = y[:r_], y[r_:2 * r_], y[2 * r_:]
                s = torch.sigmoid(gate) * s + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
                B = W2 @ torch.tanh(out)
            np.testing.assert_allclose(r.logits[k] - r.base_logits[k], B.numpy(), rtol=0, atol=1e-5,
                                       err_msg=f"slot {k + 1}")
            proj = drafter.confidence_head.proj
            inp = torch.cat([h[k], e]) if with_markov else h[k]
            assert proj.weight.shape == (1, c.hidden_size + (r_ if with_markov else 0))
            conf = (proj.weight[0] @ inp + proj.bias[0]).item()
            assert abs(r.confidence_logits[k] - conf) <= 1e-5, (k, r.confidence_logits[k], conf)
