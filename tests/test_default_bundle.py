"""End to end on the default bundle (SmolLM2-135M-Instruct + the project's drafter):
`dspark export` once per session (or $DSPARK_BUNDLE), then the runtime against the torch
reference and against transformers' own greedy `generate` on the same GGUF."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from factories import reference_logits, step_batch

from dspark.export import TorchBackend
from dspark.runtime.tools.cli import main
from dspark.runtime.manifest import BUNDLE_FORMAT, Manifest
from dspark.runtime.backends.onnxruntime import OrtBackend
from dspark.runtime.tools.parity import greedy_match
from dspark.runtime.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]
MAX_NEW = 48
MAX_SEQ = "512"
LOGIT_TOL = 2e-3  # absolute, on logits of magnitude ~40
FEATURE_TOL = 2e-3  # |ORT - torch| <= 2e-3 + 2e-3·|torch| elementwise (hidden states reach ~2.5e4)


@pytest.fixture(scope="module")
def manifest(default_bundle):
    return Manifest.load(default_bundle.path)


def generate_json(capsys, bundle, prompt: str, *flags: str) -> dict:
    capsys.readouterr()
    rc = main(["generate", "--bundle", str(bundle), "--prompt", prompt, "--max-new-tokens", str(MAX_NEW),
               "--max-seq", MAX_SEQ, "--json", *flags])
    out = capsys.readouterr().out
    assert rc == 0
    return json.loads(out)


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def test_manifest_is_valid_and_labelled(default_bundle, manifest):
    m = manifest
    assert m.bundle_format == BUNDLE_FORMAT and m.dtype == "float32"
    assert m.graphs == {"target_ort": "target_ort.onnx", "drafter": "drafter.onnx",
                        "drafter_ort": "drafter_ort.onnx", "drafter_ort_greedy": "drafter_ort_greedy.onnx"}
    assert m.tokenizer == "tokenizer.json"
    assert m.extra["weights"] == "weights.bin"
    for name in (*m.graphs.values(), "weights.bin", "tokenizer.json"):
        assert m.files[name] == (default_bundle.path / name).stat().st_size
    assert not list(default_bundle.path.glob("*.data"))  # every weight lives in weights.bin
    t, d = m.target, m.drafter
    assert (t.arch, t.num_layers, t.vocab_size, t.hidden_size) == ("llama", 30, 49152, 576)
    assert d.vocab_size == t.vocab_size and d.num_target_layers == t.num_layers and d.block_size >= 1
    assert d.enable_confidence_head and d.mask_token_id == m.special_tokens["mask_token_id"] == 16
    assert 2 in m.stop_token_ids and m.special_tokens["eos_token"] == "<|im_end|>"
    assert m.chat_template and "<|im_start|>" in m.chat_template
    assert len(m.source_hashes["target"]) == 64
    if m.source_hashes["drafter"] == "untrained":  # no trained drafter ships yet
        assert m.drafter_label.startswith("untrained") and "no speedup" in m.drafter_label
    else:
        assert not m.drafter_label.startswith("untrained")
    assert set(m.extra["ops"]) == set(m.graphs)


def test_target_graph_matches_torch(default_bundle, manifest, smollm2):
    """Prefill (every row) and two verification steps (S = γ+1, the second after a partial
    accept): logits within 2e-3 with the same argmax at every row, features within
    2e-3 + 2e-3·|ref| elementwise."""
    gamma = manifest.drafter.block_size
    ort_be = OrtBackend(default_bundle.path, manifest, 256, speculative=False, target_graph="ort")
    ref = TorchBackend(smollm2.model, None, 256)
    ref.feature_ids = manifest.drafter.target_layer_ids  # the features the bundle's target graph returns
    ids = np.asarray(chat_ids(smollm2.tokenizer, [{"role": "user", "content": PROMPTS[2]}]), np.int64)
    n = len(ids)

    def compare(tokens, start, rows, what):
        starts = np.array([start])
        (lo,), (fo,) = ort_be.target(tokens[None], starts)
        (lr,), (fr,) = ref.target(tokens[None], starts)
        lo, lr = lo[-rows:], lr[-rows:]
        assert lo.shape == lr.shape == (rows, manifest.target.vocab_size)
        err = float(np.abs(lo - lr).max())
        assert err <= LOGIT_TOL, f"{what}: logits differ by {err:.3g}"
        assert (lo.argmax(-1) == lr.argmax(-1)).all(), f"{what}: argmax differs"
        assert fo.shape == fr.shape == (len(tokens), manifest.drafter.feature_dim)
        np.testing.assert_allclose(fo, fr, rtol=FEATURE_TOL, atol=FEATURE_TOL, err_msg=f"{what}: features")
        return lr

    lr = compare(ids, 0, n, "prefill")
    anchor = int(lr[-1].argmax())
    block = np.asarray([anchor, *lr.argmax(-1)[-gamma:]], np.int64)  # real tokens, mostly rejected drafts
    lr = compare(block, n, gamma + 1, "verify 1")
    a = 2  # accept two, then verify the next block from the emitted token
    block2 = np.asarray([int(lr[a].argmax()), *lr.argmax(-1)[:gamma]], np.int64)
    compare(block2, n + a + 1, gamma + 1, "verify 2")


def same_draws(got: np.ndarray, ref: np.ndarray, ref_probs: np.ndarray, u: np.ndarray, where: str,
               tol: float = 2e-3) -> int:
    """Draft tokens equal slot by slot, except that a sampled slot may split where its uniform
    lies within `tol` of the reference CDF boundary between the two tokens (probabilities agree
    to ~1e-3, dspark.md §1's floating-point sense). Returns the slots that are comparable: all,
    or up to and including the split (later slots are drawn after different tokens)."""
    for k, (a, b) in enumerate(zip(got.tolist(), ref.tolist())):
        if a != b:
            cdf = np.cumsum(ref_probs[k], dtype=np.float64)
            gap = abs(cdf[min(a, b)] - u[k] * cdf[-1])
            assert gap < tol, f"{where}: slot {k} drew {a} vs {b}, uniform {gap:.2g} from the CDF boundary"
            return k + 1
    return len(ref)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafter_graph_matches_torch(default_bundle, manifest, smollm2, temperature):
    """The bundle's fp32 drafter graph against the torch reference of the same drafter (the
    shipped checkpoint, or the deterministic untrained default) on real SmolLM2 features:
    two rounds, same uniforms; draft probabilities and confidence logits within 2e-3,
    identical draft tokens."""
    from dspark.export.bundle import resolve_drafter

    drafter, label, _ = resolve_drafter(smollm2, None)
    assert label == manifest.drafter_label, "the bundle was exported with another drafter than the default"
    ort_be = OrtBackend(default_bundle.path, manifest, 256, drafter_graph="fp32")
    ref = TorchBackend(smollm2.model, drafter, 256)
    ids = np.asarray(chat_ids(smollm2.tokenizer, [{"role": "user", "content": PROMPTS[2]}]), np.int64)
    n, gamma = len(ids), manifest.drafter.block_size
    (logits,), (feats,) = ref.target(ids[None], np.zeros(1, np.int64))
    anchor, rng = int(logits[-1].argmax()), np.random.default_rng(0)
    ctx, ctx_start, start = feats, 0, n
    for round_ in range(2):
        args = (np.array([len(ctx)]), np.array([ctx_start]), np.array([anchor]), np.array([temperature]),
                rng.random((1, gamma)))
        do = ort_be.draft(step_batch(ctx[None], *args))
        dr = ref.draft(step_batch(ctx[None], *args))
        k = same_draws(do.tokens[0], dr.tokens[0], dr.probs[0], args[-1][0], f"round {round_}")
        np.testing.assert_allclose(do.probs[0, :k], dr.probs[0, :k], atol=2e-3, err_msg=f"round {round_}: draft probs")
        np.testing.assert_allclose(do.confidence_logits[0, :k], dr.confidence_logits[0, :k], atol=2e-3)
        block = np.concatenate([[anchor], dr.tokens[0]]).astype(np.int64)
        (logits,), (feats,) = ref.target(block[None], np.array([start]))
        ctx, ctx_start, start, anchor = feats[:2], start, start + 2, int(logits[1].argmax())


@pytest.fixture(scope="module")
def transformers_greedy(smollm2, smollm2_hf):
    """transformers' own greedy generate on the GGUF: prompt ids, generated ids, their logits."""
    out = []
    for prompt in PROMPTS:
        enc = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                    return_dict=True, return_tensors="pt")
        with torch.inference_mode():
            g = smollm2_hf.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
        n = enc["input_ids"].shape[1]
        out.append((enc["input_ids"][0].tolist(), g.sequences[0, n:].tolist(),
                    torch.stack(g.logits, 1)[0].float().numpy()))
    return out


def test_greedy_cli_matches_transformers(default_bundle, manifest, transformers_greedy, capsys):
    gamma = manifest.drafter.block_size
    for prompt, (prompt_ids, ref_ids, ref_logits) in zip(PROMPTS, transformers_greedy):
        r = generate_json(capsys, default_bundle.path, prompt)
        assert r["prompt_tokens"] == len(prompt_ids)
        m = greedy_match(ref_ids, r["token_ids"], ref_logits)
        assert m.ok, f"{prompt!r}: {m}\n transformers: {ref_ids}\n dspark:       {r['token_ids']}"
        assert r["finish_reason"] == ("stop" if r["token_ids"][-1] in manifest.stop_token_ids else "length")
        assert r["text"].strip() and isinstance(r["text"], str)
        s = r["stats"]
        assert s["tau"] >= 1.0 and s["cycles"] >= 1 and s["tokens_per_s"] > 0
        assert len(s["per_position_acceptance"]) == gamma
        assert all(p is None or 0.0 <= p <= 1.0 for p in s["per_position_acceptance"])
        assert {"prefill", "draft", "verify", "total"} <= set(s["times_s"])
        assert 0 < s["times_s"]["prefill"] <= s["times_s"]["total"]


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "What is 17 * 23?"}],
    [{"role": "user", "content": "Hi, who are you?"},
     {"role": "assistant", "content": "I am SmolLM, an assistant."},
     {"role": "user", "content": "Tell me a joke\nabout  cats."}],
    [{"role": "system", "content": "Answer in French."},
     {"role": "user", "content": "Good morning"},
     {"role": "assistant", "content": "Bonjour !"},
     {"role": "user", "content": "  Caf\u00e9, na\u00efve, \u65e5\u672c\u8a9e \U0001F600  "}],
]


def test_chat_template_matches_transformers(default_bundle, manifest, smollm2):
    ours = ChatTokenizer(default_bundle.path / manifest.tokenizer, manifest.chat_template, manifest.special_tokens)
    for messages in CONVERSATIONS:
        assert ours.encode_chat(messages) == chat_ids(smollm2.tokenizer, messages), messages
        assert ours.render(messages) == smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                              tokenize=False)


def test_no_speculation_gives_the_same_tokens(default_bundle, smollm2, capsys):
    prompt = PROMPTS[1]
    spec = generate_json(capsys, default_bundle.path, prompt, "--scheduler", "fixed")
    alone = generate_json(capsys, default_bundle.path, prompt, "--no-speculation")
    thr = generate_json(capsys, default_bundle.path, prompt, "--scheduler", "threshold")
    ids = chat_ids(smollm2.tokenizer, [{"role": "user", "content": prompt}])
    ref = reference_logits(smollm2.model, ids, alone["token_ids"])
    for other in (spec, thr):
        m = greedy_match(alone["token_ids"], other["token_ids"], ref)
        assert m.ok, str(m)
    assert alone["stats"]["mean_verified"] == 0 and spec["stats"]["mean_verified"] > 0


def test_chat_over_stdin(default_bundle):
    p = subprocess.run([sys.executable, "-m", "dspark.runtime.tools.cli", "chat", "--bundle", str(default_bundle.path),
                        "--max-new-tokens", "24", "--max-seq", MAX_SEQ],
                       input="Hello\n/exit\n", capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "chatting with" in p.stderr and "τ =" in p.stderr
    reply = p.stdout.replace(">", "").strip()
    assert reply, f"no reply in {p.stdout!r}"


def test_torch_backend_accepts_the_default_bundle(default_bundle, manifest):
    """`dspark validate --backend torch` rebuilds the bundle's sources from `dspark export`'s
    defaults: the shipped drafter must be recognised by its hash (not taken for "untrained")."""
    from dspark.export.backends import torch_backend

    backend = torch_backend("torch", manifest, 64, None, None)
    assert backend.block_size == manifest.drafter.block_size
