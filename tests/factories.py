"""Tiny random models for fast tests."""
from __future__ import annotations

import numpy as np
import torch

from dspark.export.drafter import Drafter
from dspark.export.target import TargetModel
from dspark.runtime import Calibration, SpsTable
from dspark.runtime.config import DrafterConfig, TargetConfig


def hf_target_config(arch: str = "llama", vocab: int = 97, hidden: int = 64, layers: int = 4, heads: int = 4,
                     kv_heads: int = 2, head_dim: int | None = None, tie: bool = False) -> dict:
    cfg = {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden + 8,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    return cfg


def hf_drafter_config(target: dict, *, layers: int = 2, block_size: int = 4, layer_ids=(-1, 1, 2),
                      markov_rank: int = 8, head: str | None = "vanilla", confidence: bool = True,
                      with_markov: bool = True, mask_token_id: int = 3) -> dict:
    cfg = {k: v for k, v in target.items() if k not in ("num_hidden_layers", "model_type")}
    cfg.update(
        model_type="qwen3",
        architectures=["Qwen3DSparkModel" if markov_rank else "Qwen3DFlashModel"],
        num_hidden_layers=layers,
        num_target_layers=target["num_hidden_layers"],
        block_size=block_size,
        target_layer_ids=list(layer_ids),
        mask_token_id=mask_token_id,
        num_anchors=512,
        markov_rank=markov_rank,
        tie_word_embeddings=False,
    )
    if markov_rank:
        cfg["markov_head_type"] = head
    cfg["enable_confidence_head"] = confidence
    if confidence:
        cfg["confidence_head_with_markov"] = with_markov and markov_rank > 0
    return cfg


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.5) -> torch.nn.Module:
    """Deterministic random weights, norms near 1, so every path carries signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
    return module


def tiny_target(arch: str = "llama", seed: int = 0, **kw) -> TargetModel:
    return randomize(TargetModel(TargetConfig.from_hf(hf_target_config(arch, **kw))), seed).eval()


def tiny_drafter(target: TargetModel, seed: int = 1, target_hf: dict | None = None, **kw) -> Drafter:
    hf = target_hf or hf_target_config(target.cfg.arch, vocab=target.cfg.vocab_size,
                                       hidden=target.cfg.hidden_size, layers=target.cfg.num_layers,
                                       heads=target.cfg.num_heads, kv_heads=target.cfg.num_kv_heads)
    d = randomize(Drafter(DrafterConfig.from_hf(hf_drafter_config(hf, **kw))), seed)
    with torch.no_grad():  # the drafter shares the target's frozen embedding and LM head
        d.embed_tokens.weight.copy_(target.embed_tokens.weight)
        d.lm_head.weight.copy_(target.lm_head.weight)
    return d.eval()


def copy_drafter(target: TargetModel, block_size: int = 4, seed: int = 1, boost: float = 30.0, **kw) -> Drafter:
    """A drafter whose Markov bias makes every slot repeat the previous token.

    Tiny random targets fall into repetition loops, so this drafter is accepted often
    there and rejected elsewhere: both paths of the loop get exercised."""
    V = target.cfg.vocab_size
    d = tiny_drafter(target, seed=seed, block_size=block_size, markov_rank=V, head="vanilla", **kw)
    with torch.no_grad():
        d.markov_head.markov_w1.weight.copy_(boost * torch.eye(V))
        d.markov_head.markov_w2.weight.copy_(torch.eye(V))
        d.confidence_head.proj.weight.mul_(20.0)  # spread sigmoid(c) over (0, 1) so thresholds bite
    return d


def reference_logits(target: TargetModel, prompt: list[int], generated: list[int]):
    """Logits [len(generated), V] that produced each generated token, in one full forward."""
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.inference_mode():
        logits, _ = target.new_cache(1, ids.shape[1]).run(target, ids, 0)
    return logits[0, len(prompt) - 1:].float().numpy()


# --- Tiny Hugging Face directories and bundles (for the exported-engine tests) ---------------------

TINY_SPECIAL_TOKENS = ["<unk>", "<s>", "<|im_end|>", "<mask>", "<|im_start|>"]  # ids 0..4
TINY_CHARS = (list("abcdefghijklmnopqrstuvwxyz") + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ") + list("0123456789")
              + list(" \n.,!?:;'\"-()[]{}<>@#$%&*+=_/|~^"))
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# The tiny bundle's synthetic SPS table: verification gets dearer with the batch; drafting costs a
# third of a one-token step.
TINY_SPS = SpsTable(tuple(1.0 / (1.0 + 0.12 * (b - 1)) for b in range(1, 16)), (0.3, 0.35, 0.4))
TINY_CALIBRATION = Calibration((1.5, 1.0, 0.8, 1.2))


def tiny_tokenizer():
    """A character-level `tokenizers` tokenizer (BPE without merges) wrapped as a transformers
    PreTrainedTokenizerFast with a ChatML-like chat template; eos = <|im_end|> (id 2)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TINY_SPECIAL_TOKENS + TINY_CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(TINY_SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   unk_token="<unk>", mask_token="<mask>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def write_tiny_hf_target(directory, seed: int = 0, layers: int = 4, tie: bool = False):
    """A random Llama (GQA: 4 heads, 2 KV heads; hidden 64; `tie`: the LM head is the embedding)
    saved with transformers' save_pretrained, plus `tiny_tokenizer()`: a directory `load_target`
    accepts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    vocab = len(tok)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=136, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = randomize(LlamaForCausalLM(cfg), seed).eval()
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model, tok


def import_blocker(*blocked: str) -> str:
    """Python source that makes importing any of `blocked` (packages, with their submodules) fail
    and records the attempts in `attempts`: the prelude of subprocess checks that a module does
    without them."""
    return f"""
import importlib.abc, json, sys
BLOCKED, attempts = {blocked!r}, []

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            attempts.append(name)
            raise ImportError(f"{{name}} is blocked: the runtime must not need it")
        return None

sys.meta_path.insert(0, Blocker())
"""


def step_batch(features, counts, ctx_starts, anchors, temperatures, uniforms, floors=None):
    """A `StepBatch` for a drafting round from per-row arrays: features [B, n, F], counts [B],
    ctx_starts [B] (the first new context row's position), anchors [B], temperatures [B],
    draft uniforms [B, γ], floors [B] (default 0)."""
    import numpy as np

    from dspark.runtime.backends import StepBatch

    counts, ctx_starts = np.asarray(counts, np.int64), np.asarray(ctx_starts, np.int64)
    B, gamma = np.shape(uniforms)
    u = np.zeros((B, 2 * gamma + 1))
    u[:, :gamma] = uniforms
    return StepBatch(np.asarray(features, np.float32), counts,
                     np.zeros(B, np.int64) if floors is None else np.asarray(floors, np.int64), ctx_starts + counts,
                     np.asarray(anchors, np.int64), np.asarray(temperatures, np.float64), u, np.zeros(B, np.int64))


class Replay:
    """A scheduler that repeats one request's recorded decisions (its Stats), cycle by cycle: whether
    the drafter ran, and ℓ. Run alone under it, a request meets exactly the decisions it met in a
    batch, so its sampled output must be the batch's token for token: nothing else of the batch
    may reach it."""

    name = "replay"

    def __init__(self, stats):
        self.drafted, self.verified, self.cycle = list(stats.drafted), list(stats.verified), 0

    def should_draft(self, history, rows: int) -> bool:
        self.cycle += 1
        return self.drafted[self.cycle - 1]

    def lengths(self, confidence_logits, history):
        import numpy as np

        return np.array([self.verified[self.cycle - 1]], np.int64)


def assert_rows_invariant(engine, prompts: list[str], S: int = 8) -> None:
    """The ONNX Runtime target scores a row with the same bits whatever the call holds: one call
    of S rows against S calls of one row at the same positions, and a request in a 2-slot batch
    (another request at another position beside it) against the same request alone. `engine`
    must have 2 slots."""
    be = engine.backend
    ids = [np.asarray(engine.encode(p), np.int64) for p in prompts[:2]]
    for slot in (0, 1):
        be.prefill(slot, ids[slot], ingest=False)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, be.vocab_size, (2, S))  # [2, S]
    starts = np.array([len(x) for x in ids], np.int64)  # [2]
    batched, batched_feats = be.target(tokens, starts)  # [2, S, V], [2, S, F]
    solo, solo_feats = be.target(tokens[:1], starts[:1])  # slot 0 alone
    assert np.array_equal(batched[:1], solo) and np.array_equal(batched_feats[:1], solo_feats), \
        "a row's logits depend on the other slot of the call"
    for j in range(S):  # slot 0, one row per call (rewriting the cache rows the S-row call wrote)
        row, row_feats = be.target(tokens[:1, j:j + 1], starts[:1] + j)
        diff = np.abs(row[0, 0] - solo[0, j]).max()
        assert np.array_equal(row[0, 0], solo[0, j]) and np.array_equal(row_feats[0, 0], solo_feats[0, j]), \
            f"row {j}: logits of a 1-row call differ from the {S}-row call by {diff:.3g}"


def assert_symmetric_matmulnbits(graph_path) -> int:
    """The graph as the runtime's sessions run it (ONNX Runtime's optimizations with the
    runtime's session options) holds no `DequantizeLinear` (each was fused with its MatMul into
    `MatMulNBits`: the exported form is QDQ) and no `MatMulNBits` with zero points (input 3):
    zero points take the asymmetric int8 kernel of onnxruntime issue #29853, wrong at M = 1 on
    AVX2. Returns how many `MatMulNBits` it checked."""
    import tempfile
    from pathlib import Path

    import onnx
    import onnxruntime as ort

    from dspark.runtime.backends.onnxruntime import session_options

    with tempfile.TemporaryDirectory() as tmp:
        so = session_options(1)
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        so.log_severity_level = 3
        ort.InferenceSession(str(graph_path), so, providers=["CPUExecutionProvider"])
        graph = onnx.load(so.optimized_model_filepath, load_external_data=False).graph
    left = [n.name for n in graph.node if n.op_type == "DequantizeLinear"]
    assert not left, f"DequantizeLinear not fused into MatMulNBits: {left[:5]}"
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    for n in nodes:
        assert len(n.input) < 4 or not n.input[3], f"{n.name} has zero points ({n.input[3]}): onnxruntime #29853"
    return len(nodes)
