"""The draft vocabulary (`dspark export --draft-vocab K`): the drafter graphs propose from K ids
only, keep the whole vocabulary's ids and distribution width, and the output stays the target's."""
from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
import torch
from factories import tiny_drafter, tiny_target

from dspark.export.draft_vocab import choose_vocab, count_responses, count_tokens, load_counts, save_counts
from dspark.export.graphs import DrafterGraph
from dspark.runtime.errors import ConfigError


def test_choose_vocab_orders_by_count_then_id_and_keeps_stop_tokens():
    counts = np.array([0, 5, 0, 9, 5, 1, 0, 0])
    assert choose_vocab(3, 8, keep=[7], counts=counts).tolist() == [1, 3, 7]  # 9, then 5 and 5 by id: 1
    assert choose_vocab(4, 8, keep=[7], counts=counts).tolist() == [1, 3, 4, 7]
    assert choose_vocab(3, 8, keep=[6]).tolist() == [0, 1, 6]  # no counts: the lowest ids
    assert choose_vocab(8, 8, keep=[2]).tolist() == list(range(8))
    for bad in (0, 9):
        with pytest.raises(ConfigError, match="expected 1..8"):
            choose_vocab(bad, 8, keep=[])
    with pytest.raises(ConfigError, match="stop tokens"):
        choose_vocab(1, 8, keep=[2, 3])


def test_counts_round_trip(tmp_path):
    counts = count_tokens([[1, 2, 2], [5, 2]], 8)
    assert counts.tolist() == [0, 1, 3, 0, 0, 1, 0, 0]
    assert load_counts(tmp_path, 8) is None
    save_counts(tmp_path, counts, "two sequences")
    back, source = load_counts(tmp_path, 8)
    assert back.tolist() == counts.tolist() and "5 tokens of two sequences" == source
    with pytest.raises(ConfigError, match="vocabulary of 8 tokens"):
        load_counts(tmp_path, 9)
    (tmp_path / "data" / "responses").mkdir(parents=True)
    rows = [{"key": "a", "prompt_ids": [7, 7], "response_ids": [1, 2, 2]}, {"key": "b", "prompt_ids": [7], "response_ids": [5, 2]}]
    (tmp_path / "data" / "responses" / "responses-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_data, source = count_responses(tmp_path / "data", 8)  # response tokens only, not the prompts'
    assert from_data.tolist() == counts.tolist() and source == "the responses of 2 training sequences"


def _inputs(drafter, B=2, n=3, P=4, smax=16, temperature=1.0, seed=0):
    c = drafter.cfg
    g = torch.Generator().manual_seed(seed)
    past = [torch.randn(B, c.num_kv_heads, smax, c.head_dim, generator=g) for _ in range(2 * c.num_layers)]
    return (torch.randn(B, n, c.feature_dim, generator=g), torch.arange(P, P + n + c.block_size).expand(B, -1),
            torch.tensor([5, 11]), torch.full((B,), temperature), torch.rand(B, c.block_size, generator=g),
            torch.zeros(B, P), torch.zeros(B, n), *past)


@pytest.mark.parametrize("mode", ["sampled", "greedy"])
def test_graph_restricted_to_a_vocabulary(mode):
    """Greedy: with every full-vocabulary draft inside the draft vocabulary, the same drafts and
    confidences. Sampled: tokens inside it, distributions supported on it and summing to 1, and
    slot 1's distribution the full one's renormalised over it."""
    t = tiny_target()
    d = tiny_drafter(t, seed=3, block_size=4, layer_ids=(-1, 1, 2))
    V = d.cfg.vocab_size
    temp = 0.0 if mode == "greedy" else 1.0
    branch = "cond" if mode == "greedy" else "sampled"  # at T = 0 the `If` takes the greedy branch
    args = _inputs(d, temperature=temp)
    with torch.no_grad():
        full = DrafterGraph(d, branch).eval()(*args)
        everything = DrafterGraph(d, branch, torch.arange(V)).eval()(*args)
        for a, b in zip(full, everything):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        tokens = full[0]  # [B, γ]
        extra = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:V // 3]
        vocab = torch.unique(torch.cat([tokens.flatten(), extra]))  # sorted, distinct
        sub = DrafterGraph(d, branch, vocab).eval()(*args)
    assert torch.isin(sub[0], vocab).all()
    if mode == "greedy":
        assert sub[0].tolist() == tokens.tolist()
        torch.testing.assert_close(sub[2], full[2], rtol=0, atol=1e-5)  # confidence logits
        return
    probs, probs_full = sub[1], full[1]  # [B, γ, V]
    outside = torch.ones(V, dtype=torch.bool)
    outside[vocab] = False
    assert float(probs[..., outside].abs().max()) == 0.0
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs[..., 0]))
    first = probs_full[:, 0, vocab] / probs_full[:, 0, vocab].sum(-1, keepdim=True)
    torch.testing.assert_close(probs[:, 0, vocab], first, rtol=1e-5, atol=1e-6)


def test_bundle_with_a_draft_vocabulary_is_lossless(tiny_bundle, tmp_path):
    """`export_bundle(draft_vocab_size=K)` with the drafter's token counts: the manifest says how
    the ids were chosen, every draft is one of them, greedy output is the target's alone, and a
    sampled request runs (its distributions are checked at graph level above)."""
    from dspark.export.bundle import export_bundle
    from dspark.runtime import Engine

    V = tiny_bundle.target.cfg.vocab_size
    drafter_dir = tmp_path / "drafter"
    shutil.copytree(tiny_bundle.drafter_dir, drafter_dir)
    tok = tiny_bundle.tokenizer
    text = "Hello there, how are you? What is 17 * 23? Tell me a story."
    counts = count_tokens([tok(text)["input_ids"]], V)
    save_counts(drafter_dir, counts, "a test sentence")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = export_bundle(tmp_path / "b", tiny_bundle.target_dir, drafter_dir, progress=False, quick_profile=False,
                          reuse_target=tiny_bundle.path, draft_vocab_size=30)
    assert m.extra["draft_vocab"]["size"] == 30
    assert "most frequent ids in" in m.extra["draft_vocab"]["chosen"]
    vocab = set(choose_vocab(30, V, m.stop_token_ids, counts).tolist())
    e = Engine.load(tmp_path / "b", max_seq=128, threads=1)
    drafted = []
    backend_draft = e.backend.draft
    e.backend.draft = lambda *a, **kw: drafted.append(backend_draft(*a, **kw)) or drafted[-1]
    for prompt in ("Hello there, how are you?", "Tell me a story about a dragon."):
        spec = e.generate(prompt, max_new_tokens=24, scheduler="fixed")
        assert spec.token_ids == e.generate(prompt, max_new_tokens=24, scheduler="none").token_ids
    sampled = e.generate("What is 17 * 23?", max_new_tokens=16, temperature=1.0, seed=1, scheduler="fixed")
    assert len(sampled.token_ids) > 0
    assert drafted and all(set(d.tokens.flatten().tolist()) <= vocab for d in drafted)
    for bad in (0, V + 1):  # refused before anything is exported or written
        with pytest.raises(ConfigError, match=f"expected 1..{V}"):
            export_bundle(tmp_path / "bad", tiny_bundle.target_dir, drafter_dir, progress=False, quick_profile=False,
                          reuse_target=tiny_bundle.path, draft_vocab_size=bad)
        assert not (tmp_path / "bad").exists()
