"""Our `TargetModel` (loaded through `load_target`) against transformers' own models:
logits and context features (dspark.md §2), prefill and incremental steps through the
static KV cache at explicit positions."""
from __future__ import annotations

import json

import pytest
import torch
from factories import hf_target_config, randomize

from dspark.export import load_target
from dspark.runtime.errors import CheckpointError

SEQ_LEN = 18
PROMPT_LEN = 12


def _hf_model(arch: str, seed: int, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    cfg = cfg_cls(**hf_target_config(arch, **kw), attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    return randomize(model, seed)  # larger than HF's init, so every path carries signal


def _save_tokenizer(directory, vocab: int) -> None:
    """A word-level tokenizer ("t3" -> 3, ...) so the directory is a complete HF model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)


def _calls(tokens: torch.Tensor, vocab: int) -> list[tuple[torch.Tensor, int]]:
    """(tokens, start) per target call. The verify call at 14 writes three junk rows that
    later calls overwrite (a rejection moves the length pointer back; nothing is copied)."""
    g = torch.Generator().manual_seed(123)
    junk = torch.randint(4, vocab, (3,), generator=g)
    t = tokens
    return [
        (t[:PROMPT_LEN], 0),  # prefill
        (t[12:13], 12),
        (t[13:14], 13),
        (torch.cat([t[14:15], junk]), 14),  # verify: anchor + 3 drafts, all rejected
        (t[15:17], 15),  # rewrite from the rejection point
        (t[17:18], 17),
    ]


def _ours_incremental(model, tokens: torch.Tensor, layer_ids: tuple[int, ...]):
    """Logits / features per final position, each from the last call that wrote it."""
    cache = model.new_cache(1, 32)
    logits = torch.zeros(SEQ_LEN, model.cfg.vocab_size)
    feats = torch.zeros(SEQ_LEN, len(layer_ids) * model.cfg.hidden_size)
    with torch.no_grad():
        for toks, start in _calls(tokens, model.cfg.vocab_size):
            pos = torch.arange(start, start + len(toks))
            lg, ft = cache.run(model, toks[None], start, layer_ids)
            keep = pos < SEQ_LEN
            logits[pos[keep]] = lg[0, keep]
            feats[pos[keep]] = ft[0, keep]
    return logits, feats


CASES = {
    "llama-gqa": dict(arch="llama", kw=dict(heads=4, kv_heads=2)),
    "qwen3-head_dim": dict(arch="qwen3", kw=dict(heads=4, kv_heads=2, head_dim=24)),
    "llama-tied-gqa": dict(arch="llama", kw=dict(heads=4, kv_heads=1, tie=True)),
    "qwen3-tied-mha": dict(arch="qwen3", kw=dict(heads=2, kv_heads=2, head_dim=40, tie=True, layers=3)),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_target_matches_transformers(case, sharded, tmp_path):
    arch, kw = CASES[case]["arch"], CASES[case]["kw"]
    hf = _hf_model(arch, seed=len(case), **kw)
    out = tmp_path / "model"
    if sharded:
        hf.save_pretrained(out, max_shard_size="30KB")
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 2
        assert not (out / "model.safetensors").exists()
    else:
        hf.save_pretrained(out)
        assert (out / "model.safetensors").exists()
    _save_tokenizer(out, hf.config.vocab_size)

    loaded = load_target(out)
    assert loaded.stop_token_ids == (2,)
    assert loaded.tokenizer("t5 t6")["input_ids"] == [5, 6]
    model = loaded.model
    cfg = model.cfg
    assert cfg.arch == arch
    assert cfg.head_dim == hf.config.head_dim
    assert cfg.num_kv_heads == hf.config.num_key_value_heads
    assert cfg.tie_word_embeddings == kw.get("tie", False)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    if "head_dim" in kw:
        assert cfg.head_dim != cfg.hidden_size // cfg.num_heads

    tokens = torch.randint(0, cfg.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(7))
    layer_ids = (-1, 0, cfg.num_layers - 2)
    ours_logits, ours_feats = _ours_incremental(model, tokens, layer_ids)

    with torch.no_grad():
        ref = hf(tokens[None], output_hidden_states=True)
    ref_logits = ref.logits[0]
    assert ref_logits.abs().max() > 0.5, "the reference logits should carry signal"
    assert (ours_logits - ref_logits).abs().max().item() <= 1e-4
    ref_feats = torch.cat([ref.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    assert (ours_feats - ref_feats).abs().max().item() <= 1e-4


def test_prefill_alone_matches_full_forward(tmp_path):
    """The whole sequence in one call (no incremental steps) also matches, features too."""
    hf = _hf_model("qwen3", seed=3, head_dim=24)
    hf.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path, 97)
    model = load_target(tmp_path).model
    tokens = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    layer_ids = (-1, 1, 2)
    with torch.no_grad():
        lg, ft = model.new_cache(1, 9).run(model, tokens, 0, layer_ids)
        ref = hf(tokens, output_hidden_states=True)
    assert (lg - ref.logits).abs().max().item() <= 1e-4
    ref_feats = torch.cat([ref.hidden_states[i + 1] for i in layer_ids], dim=-1)
    assert (ft - ref_feats).abs().max().item() <= 1e-4
    _, none = model.new_cache(1, 9).run(model, tokens, 0)
    assert none.shape == (1, 9, 0)


def test_bad_target_directories(tmp_path):
    hf = _hf_model("llama", seed=0)
    hf.save_pretrained(tmp_path / "no_tokenizer")
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_target(tmp_path / "no_tokenizer")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_target(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_target(tmp_path / "empty")
    # a missing weight and a misshapen weight are named
    from safetensors.torch import load_file, save_file

    for name, edit, pattern in (
        ("missing", lambda st: st.pop("model.layers.1.mlp.up_proj.weight"), "layers.1.mlp.up_proj.weight is missing"),
        ("shape", lambda st: st.update({"model.norm.weight": torch.ones(65)}), r"norm.weight has shape \(65,\), expected \(64,\)"),
    ):
        d = tmp_path / name
        hf.save_pretrained(d)
        _save_tokenizer(d, 97)
        st = load_file(d / "model.safetensors")
        edit(st)
        save_file(st, d / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=pattern):
            load_target(d)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2, smollm2_hf):
    """The real SmolLM2 GGUF: ours (prefill + greedy steps through the cache) vs
    transformers' full-sequence forward on a chat-templated prompt."""
    tok = smollm2.tokenizer
    model = smollm2.model
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer briefly."}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    n, steps = len(prompt), 10
    assert n > 10
    layer_ids = (-1, 0, 15, 28)  # 30 layers; 28 is the last allowed feature layer
    assert model.cfg.num_layers == 30

    cache = model.new_cache(1, n + steps)
    seq = list(prompt)
    with torch.no_grad():
        lg, ft = cache.run(model, torch.tensor([prompt]), 0, layer_ids)
        logits, feats = [lg[0]], [ft[0]]
        for _ in range(steps):
            nxt = int(logits[-1][-1].argmax())
            seq.append(nxt)
            p = len(seq) - 1
            lg, ft = cache.run(model, torch.tensor([[nxt]]), p, layer_ids)
            logits.append(lg[0])
            feats.append(ft[0])
        ours = torch.cat(logits)[: len(seq)]
        ours_feats = torch.cat(feats)[: len(seq)]
        ref = smollm2_hf(torch.tensor([seq]), output_hidden_states=True)
    ref_logits = ref.logits[0]
    diff = (ours - ref_logits).abs().max().item()
    print(f"SmolLM2: {len(seq)} positions, max |Δlogit| = {diff:.2e}")
    assert diff <= 2e-3, f"max |Δlogit| = {diff}"
    assert torch.equal(ours.argmax(-1), ref_logits.argmax(-1))
    ref_feats = torch.cat([ref.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    scale = ref_feats.abs().max().item()
    assert (ours_feats - ref_feats).abs().max().item() <= 1e-4 * max(1.0, scale)
    # the greedy continuation is coherent: it mentions Paris
    assert "Paris" in tok.decode(seq[n:]), tok.decode(seq[n:])
