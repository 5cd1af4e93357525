"""Drafter training (dspark.md §6) on tiny random models: anchors and blocks, the batched
training forward against the inference path, the losses by hand, optimisation, checkpoint
resume, and the data pipeline (prompts, generation, feature cache)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import tiny_drafter, tiny_target, write_tiny_hf_target

from dspark.export import DraftSession, load_drafter, load_target, save_drafter
from dspark.export.train_data import (DEFAULT_TRAIN_DIR, DataError, FeatureCache, GenerationConfig,
                                      EngineResponder, OnTheFlySource, Prompt, TorchStates, TransformersResponder,
                                      cache_features,
                                      first_question, generate_responses,
                                      load_generator, load_train_prompts, read_prompts, read_responses, response_seed,
                                      synthesize_prompts, target_states)
from dspark.export.training import (BatchPlan, architecture_of, DistillLoss, TrainConfig, TrainSequence, Trainer, anchor_candidates, build_blocks,
                                    build_drafter, check_resume_config, collate, compute_loss, draft_block_states, draft_losses,
                                    drafter_param_count, evaluate, lr_at, make_batch, max_markov_rank, sample_anchors,
                                    slot_weights, teacher_forced_heads, teacher_logits, teacher_vocab_logits)
from dspark.runtime.errors import ConfigError

GAMMA = 4
LAYER_IDS = (-1, 1, 2)
HEADS = {
    "vanilla": dict(markov_rank=8, head="vanilla"),
    "gated": dict(markov_rank=8, head="gated"),
    "rnn": dict(markov_rank=8, head="rnn"),
    "dflash": dict(markov_rank=0, confidence=False),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=0)


def _sequence(target, T: int, prompt_len: int, seed: int) -> TrainSequence:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, target.cfg.vocab_size, (T,), generator=g)
    mask = torch.arange(T) >= prompt_len
    feats, hidden = target_states(target, tokens[None], LAYER_IDS)
    return TrainSequence(tokens, mask, feats[0], hidden[0])


class ListSource:
    """An in-memory SequenceSource."""

    def __init__(self, seqs: list[TrainSequence], tag: str = "list"):
        self.seqs, self.tag = seqs, tag

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> TrainSequence:
        return self.seqs[i]

    def fingerprint(self) -> str:
        return f"{self.tag}-{len(self.seqs)}"


class Untouchable(ListSource):
    def __getitem__(self, i: int) -> TrainSequence:
        raise AssertionError("data was read before the config check")


def _cfg(**kw) -> TrainConfig:
    base = dict(block_size=GAMMA, num_layers=2, target_layer_ids=LAYER_IDS, markov_rank=8, mask_token_id=3,
                anchors_per_seq=512, max_seq_len=64, lr=3e-3, warmup_steps=0, steps=20, batch=2, seed=0)
    return TrainConfig(**{**base, **kw})


# --- anchors and blocks ----------------------------------------------------------------------------


def test_anchor_candidates_are_response_pairs():
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert anchor_candidates(mask).tolist() == [3, 4, 5, 8]  # p and p+1 both response
    assert anchor_candidates(torch.tensor([0, 1, 0, 1], dtype=torch.bool)).numel() == 0


def test_sample_anchors_cap_uniform_without_replacement():
    mask = torch.arange(40) >= 20  # candidates 20..38
    g = torch.Generator().manual_seed(0)
    counts = np.zeros(40)
    for _ in range(600):
        a = sample_anchors(mask, 5, g)
        assert len(a) == 5 and len(set(a.tolist())) == 5 and a.tolist() == sorted(a.tolist())
        assert all(20 <= p <= 38 for p in a.tolist())
        counts[a.numpy()] += 1
    expected = 600 * 5 / 19
    assert np.abs(counts[20:39] - expected).max() < 0.35 * expected  # uniform over the candidates
    assert sample_anchors(mask, 512, g).tolist() == list(range(20, 39))  # under the cap: all of them
    with pytest.raises(ConfigError, match="anchors_per_seq"):
        _cfg(anchors_per_seq=513)


def test_blocks_targets_and_validity_stop_past_the_response():
    tokens = torch.arange(100, 112)  # x[i] = 100 + i
    mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)  # response 4..9
    b = build_blocks(tokens, mask, torch.tensor([4, 7, 8]), block_size=4, mask_token_id=3)
    assert b.inputs.tolist() == [[104, 3, 3, 3], [107, 3, 3, 3], [108, 3, 3, 3]]
    assert b.positions.tolist() == [[4, 5, 6, 7], [7, 8, 9, 10], [8, 9, 10, 11]]
    assert b.prev.tolist() == [[104, 105, 106, 107], [107, 108, 109, 110], [108, 109, 110, 111]]
    assert b.valid.tolist() == [[True] * 4, [True, True, False, False], [True, False, False, False]]
    assert b.labels[0].tolist() == [105, 106, 107, 108] and b.labels[1, :2].tolist() == [108, 109]
    # past the end of the sequence, and a response that resumes after a gap: still stopped
    mask2 = torch.tensor([0, 1, 1, 0, 1, 1], dtype=torch.bool)
    b2 = build_blocks(torch.arange(6), mask2, torch.tensor([1, 4]), block_size=3, mask_token_id=3)
    assert b2.valid.tolist() == [[True, False, False], [True, False, False]]


# --- the key test: training forward == inference path ----------------------------------------------


@pytest.mark.parametrize("head", list(HEADS))
def test_batched_forward_equals_draft_session(target, head):
    d = tiny_drafter(target, seed=1, block_size=GAMMA, layer_ids=LAYER_IDS, **HEADS[head])
    s1, s2 = _sequence(target, 24, 8, seed=0), _sequence(target, 17, 5, seed=1)
    anchors = anchor_candidates(s1.response_mask)
    blocks = build_blocks(s1.tokens, s1.response_mask, anchors, GAMMA, d.cfg.mask_token_id)
    with torch.no_grad():
        h = draft_block_states(d, s1.features[None], anchors[None], blocks.inputs[None], blocks.positions[None])[0]
        heads = teacher_forced_heads(d, h, blocks.prev)
    T = len(s1.tokens)
    for i, p in enumerate(anchors.tolist()):
        session = DraftSession(d, max_len=64)
        feats = s1.features[:p].numpy()  # context: rows strictly before the anchor
        if p + GAMMA < T:  # teacher forcing = the sequential stage with the ground truth forced
            r = session.draft(feats, int(s1.tokens[p]), p, 1.0, forced_tokens=s1.tokens[p + 1:p + 1 + GAMMA].numpy())
            np.testing.assert_allclose(r.logits, heads.logits[i].numpy(), atol=1e-4, rtol=0)
            if d.confidence_head is not None:
                np.testing.assert_allclose(r.confidence_logits, heads.confidence_logits[i].numpy(), atol=1e-4, rtol=0)
        else:
            r = session.draft(feats, int(s1.tokens[p]), p, 0.0)
        np.testing.assert_allclose(r.base_logits, heads.base_logits[i].numpy(), atol=1e-4, rtol=0)
    # padded batch of two sequences of different lengths: the first one's blocks are unchanged
    b2 = build_blocks(s2.tokens, s2.response_mask, anchor_candidates(s2.response_mask)[:3], GAMMA, 3)
    batch = collate([(s1, blocks), (s2, b2)], d.cfg.mask_token_id)
    with torch.no_grad():
        hb = draft_block_states(d, batch.features, batch.anchors, batch.inputs, batch.positions)
    torch.testing.assert_close(hb[0, :len(anchors)], h, atol=1e-5, rtol=0)


# --- losses ----------------------------------------------------------------------------------------


def test_losses_by_hand():
    cfg = _cfg()
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])  # [N=1, γ=2, V=3]
    tlogits = torch.tensor([[[1.0, 1.0, 0.0], [0.0, 3.0, 0.0]]])
    conf = torch.tensor([[0.3, -0.7]])
    labels = torch.tensor([[0, 1]])
    valid = torch.tensor([[True, True]])

    def sm(z):
        e = np.exp(np.asarray(z) - np.max(z))
        return e / e.sum()

    w = np.exp(-np.arange(2) / 4.0)
    pd = [sm(logits[0, k].numpy()) for k in range(2)]
    pt = [sm(tlogits[0, k].numpy()) for k in range(2)]
    l1 = np.array([np.abs(pd[k] - pt[k]).sum() for k in range(2)])
    cstar = 1 - 0.5 * l1
    ce = np.array([-math.log(pd[0][0]), -math.log(pd[1][1])])
    sig = 1 / (1 + np.exp(-conf[0].numpy()))
    bce = -(cstar * np.log(sig) + (1 - cstar) * np.log(1 - sig))
    wm = lambda x: (w * x).sum() / w.sum()  # noqa: E731
    t = draft_losses(logits, conf, tlogits, labels, valid, cfg)
    assert t.tv.item() == pytest.approx(wm(l1), abs=1e-6)
    assert t.ce.item() == pytest.approx(wm(ce), abs=1e-6)
    assert t.conf.item() == pytest.approx(wm(bce), abs=1e-6)
    assert t.total.item() == pytest.approx(0.1 * wm(ce) + 0.9 * wm(l1) + 1.0 * wm(bce), abs=1e-6)
    np.testing.assert_allclose(t.acceptance.numpy(), cstar, atol=1e-6)
    # an invalid slot drops out of numerator and denominator
    t1 = draft_losses(logits, conf, tlogits, labels, torch.tensor([[True, False]]), cfg)
    assert t1.tv.item() == pytest.approx(l1[0], abs=1e-6) and t1.ce.item() == pytest.approx(ce[0], abs=1e-6)
    assert math.isnan(t1.acceptance[1].item())
    assert slot_weights(7, 4.0).tolist() == pytest.approx([math.exp(-k / 4) for k in range(7)])


@pytest.mark.parametrize("dflash", [False, True])
def test_distill_loss_gradient_equals_autograd(dflash):
    g = torch.Generator().manual_seed(1)
    N, gamma, V = 5, 3, 40  # 15 rows: one full chunk of 16 is not reached, and CHUNK=4 below crosses chunks
    logits = (2 * torch.randn(N, gamma, V, generator=g)).requires_grad_()
    tlogits = 2 * torch.randn(N, gamma, V, generator=g)
    labels = torch.randint(0, V, (N, gamma), generator=g)
    valid = torch.rand(N, gamma, generator=g) > 0.2
    conf = torch.randn(N, gamma, generator=g).requires_grad_()
    cfg = _cfg(markov_rank=0, dflash=True) if dflash else _cfg()
    w = slot_weights(gamma, cfg.decay)[None] * valid
    # the plain autograd formulation (what the fused loss replaces)
    logp = torch.log_softmax(logits, -1)
    ce = -logp.gather(-1, labels[..., None])[..., 0]
    l1 = (logp.exp() - tlogits.softmax(-1)).abs().sum(-1)
    cstar = (1 - 0.5 * l1).detach()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, cstar, reduction="none")
    wm = lambda x: (w * x).sum() / w.sum()  # noqa: E731
    ref = wm(ce) if dflash else 0.1 * wm(ce) + 0.9 * wm(l1) + wm(bce)
    ref_grads = torch.autograd.grad(ref, [logits] if dflash else [logits, conf])
    for chunk in (16, 4):
        DistillLoss.CHUNK = chunk
        try:
            t = draft_losses(logits, None if dflash else conf, tlogits, labels, valid, cfg)
            grads = torch.autograd.grad(t.total, [logits] if dflash else [logits, conf])
        finally:
            DistillLoss.CHUNK = 16
        assert t.total.item() == pytest.approx(ref.item(), rel=1e-5)
        assert t.ce.item() == pytest.approx(wm(ce).item(), rel=1e-5) and t.tv.item() == pytest.approx(wm(l1).item(), rel=1e-5)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def test_teacher_logits_bf16_keeps_the_top_logits_exact():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(500, 32, generator=g)  # [V, d]
    hid = torch.randn(3, 2, 32, generator=g)  # [N, γ, d]
    exact = hid @ w.T  # [N, γ, V] fp32
    assert torch.equal(teacher_logits(w, hid), exact)
    fast = teacher_logits(w, hid, bf16=True, exact_top=8)
    top = exact.topk(8, dim=-1).indices
    torch.testing.assert_close(fast.gather(-1, top), exact.gather(-1, top))  # fp32 where the mass is
    err = (fast - exact).abs()
    assert 0 < err.max() < 0.05 * exact.abs().max()  # bf16 rounding elsewhere, and only that
    # the distributions a loss sees are close
    assert (fast.softmax(-1) - exact.softmax(-1)).abs().sum(-1).max() < 0.02


def test_dflash_is_ce_only(target):
    with pytest.raises(ConfigError, match="markov_rank"):
        _cfg(dflash=True)  # a DFlash drafter has no Markov head
    cfg = _cfg(markov_rank=0, dflash=True)
    d = build_drafter(target, cfg)
    assert d.markov_head is None and d.confidence_head is None
    seqs = [_sequence(target, 20, 6, seed=s) for s in range(2)]
    batch = make_batch(ListSource(seqs), BatchPlan(2, 2, 0), 0, cfg)
    t = compute_loss(d, batch, cfg)
    assert t.total.item() == pytest.approx(t.ce.item()) and t.conf.item() == 0.0
    assert not t.tv.requires_grad  # logged only
    # the same drafter scored as DSpark would add the TV term
    assert t.tv.item() > 0


def test_padding_anchors_and_length_changes_nothing(target):
    """Rounding A and T up (the allocator-friendly shapes of `make_batch`) adds only
    zero-weight rows: the loss and every gradient are those of the unpadded batch."""
    cfg = _cfg()
    d = build_drafter(target, cfg)
    s1, s2 = _sequence(target, 21, 6, seed=0), _sequence(target, 15, 5, seed=1)
    items = [(s, build_blocks(s.tokens, s.response_mask, anchor_candidates(s.response_mask)[:n], GAMMA,
                              cfg.mask_token_id)) for s, n in ((s1, 9), (s2, 4))]
    results = []
    for multiples in ((1, 1), (8, 32)):
        batch = collate(items, cfg.mask_token_id, *multiples)
        d.zero_grad(set_to_none=True)
        t = compute_loss(d, batch, cfg)
        t.total.backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        results.append((batch.anchors.shape, batch.features.shape[1], t, grads))
    (a0, t0, plain, g0), (a1, t1, padded, g1) = results
    assert (a0, t0, a1, t1) == ((2, 9), 21, (2, 16), 32)
    for name in ("total", "ce", "tv", "conf"):
        torch.testing.assert_close(getattr(padded, name), getattr(plain, name), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(padded.accept_sum, plain.accept_sum)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-4)


# --- optimisation and checkpoints ------------------------------------------------------------------


@pytest.fixture(scope="module")
def seqs(target):
    return [_sequence(target, 22, 7, seed=10), _sequence(target, 18, 6, seed=11), _sequence(target, 20, 9, seed=12)]


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(target, seqs, tmp_path):
    cfg = _cfg(batch=2, steps=12)
    data = ListSource(seqs[:2])
    trainer = Trainer.start(target, data, cfg, tmp_path / "run", progress=False, save_every=1000)
    assert not trainer.drafter.embed_tokens.weight.requires_grad and not trainer.drafter.lm_head.weight.requires_grad
    frozen = trainer.drafter.lm_head.weight.clone()
    fixed = trainer.batch(0)  # every anchor of both sequences (anchors_per_seq > candidates)
    with torch.no_grad():
        before = compute_loss(trainer.drafter, fixed, cfg).total.item()
    trainer.train()
    with torch.no_grad():
        after = compute_loss(trainer.drafter, fixed, cfg)
    assert after.total.item() < 0.8 * before
    assert torch.equal(trainer.drafter.lm_head.weight, frozen)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len(log[-1]["acceptance"]) == GAMMA and log[-1]["step"] == 12
    assert lr_at(0, _cfg(warmup_steps=10)) == pytest.approx(3e-4)


def test_warm_start_from_a_checkpoint(target, seqs, tmp_path):
    """`init_from` starts a run from a saved drafter's weights (bf16 storage, as shipped); a
    checkpoint of another architecture is refused naming the field."""
    first = Trainer.start(target, ListSource(seqs), _cfg(batch=2, steps=2), tmp_path / "a", progress=False)
    first.train()
    save_drafter(first.drafter, tmp_path / "shipped", dtype=torch.bfloat16)
    warm = Trainer.start(target, ListSource(seqs), _cfg(batch=2, steps=2, init_from=str(tmp_path / "shipped")),
                         tmp_path / "b", progress=False)
    for (name, p), q in zip(first.drafter.named_parameters(), warm.drafter.parameters()):
        torch.testing.assert_close(q, p.to(torch.bfloat16).float(), atol=0, rtol=0, msg=name)
    with pytest.raises(ConfigError, match="num_layers"):
        Trainer.start(target, ListSource(seqs), _cfg(num_layers=1, init_from=str(tmp_path / "shipped")),
                      tmp_path / "c", progress=False)


def _script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_drafter", Path(__file__).parents[1] / "scripts" / "train_drafter.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize("dflash", [False, True])
def test_evaluate_is_the_training_loss_without_an_update(target, seqs, tmp_path, dflash):
    """`evaluate` reports the loss terms and per-slot c* that `compute_loss` gives the same
    blocks (every anchor, so the draw does not matter), whatever its batch size, and changes
    no weight."""
    cfg = _cfg(batch=2, steps=3, **(dict(markov_rank=0, dflash=True) if dflash else {}))
    trainer = Trainer.start(target, ListSource(seqs[:2]), cfg, tmp_path / "run", progress=False)
    trainer.train()  # not the init: a drafter with some structure
    d = trainer.drafter
    before = [p.clone() for p in d.parameters()]
    with torch.no_grad():
        ref = compute_loss(d, trainer.batch(0), cfg)  # both sequences, every anchor
    for batch in (1, 2):
        r = evaluate(d, ListSource(seqs[:2]), cfg, batch=batch, progress=False)
        assert r.sequences == 2
        assert (r.ce, r.tv, r.conf) == pytest.approx((ref.ce.item(), ref.tv.item(), float(ref.conf)), rel=1e-5)
        assert r.acceptance == pytest.approx(ref.acceptance.tolist(), rel=1e-5)
        assert 1 < r.tau_estimate < 1 + GAMMA
    assert (r.conf == 0) == dflash and d.training
    assert all(torch.equal(a, b) for a, b in zip(before, d.parameters()))
    part = evaluate(d, ListSource(seqs), cfg, indices=[2], progress=False)
    assert part.sequences == 1 and part.ce != pytest.approx(r.ce)


def test_a_warm_start_defaults_to_the_checkpoints_architecture(target, tmp_path):
    """`train_drafter.py train --init-from CKPT` without architecture flags takes CKPT's
    (rank, layers, layer ids, ...) instead of the fresh-run defaults; a flag still overrides."""
    script = _script()
    for kw in (dict(markov_rank=24, markov_head_type="gated"), dict(markov_rank=0, dflash=True)):
        cfg = _cfg(num_layers=1, **kw)
        save_drafter(build_drafter(target, cfg), tmp_path / "ckpt", dtype=torch.bfloat16)
        arch = architecture_of(tmp_path / "ckpt")
        assert {k: getattr(cfg, k) for k in arch} == arch
        args = script.build_parser().parse_args(["train", "--init-from", str(tmp_path / "ckpt"), "--lr", "1e-4"])
        got = script._new_config(args, target.cfg, "cpu")
        assert {k: getattr(got, k) for k in arch} == arch and got.lr == 1e-4
    args = script.build_parser().parse_args(["train", "--init-from", str(tmp_path / "ckpt"), "--layers", "2"])
    assert script._new_config(args, target.cfg, "cpu").num_layers == 2  # refused later by check_drafter_matches


def test_bf16_autocast_step(target, seqs, tmp_path):
    trainer = Trainer.start(target, ListSource(seqs), _cfg(amp="bf16", batch=2, steps=2, anchors_per_seq=4),
                            tmp_path / "run", progress=False, micro_batch=1)
    stats = trainer.train()
    assert all(math.isfinite(s.loss) for s in stats) and trainer.drafter.fc.weight.dtype == torch.float32


def test_on_checkpoint_runs_after_each_checkpoint(target, seqs, tmp_path):
    seen = []
    trainer = Trainer.start(target, ListSource(seqs), _cfg(batch=2, steps=5, anchors_per_seq=4), tmp_path / "run",
                            progress=False, save_every=2, on_checkpoint=lambda: seen.append(trainer.step_idx))
    trainer.train()
    assert seen == [2, 4]  # not after the final save at step 5, which `train` writes when it stops


def test_micro_batches_give_the_same_step(target, seqs, tmp_path):
    cfg = _cfg(batch=3, steps=2, anchors_per_seq=6)
    runs = [Trainer.start(target, ListSource(seqs), cfg, tmp_path / f"m{mb}", progress=False, micro_batch=mb)
            for mb in (None, 1)]
    stats = [r.train() for r in runs]
    assert [s.loss for s in stats[0]] == pytest.approx([s.loss for s in stats[1]], abs=1e-5)
    torch.testing.assert_close(runs[0].drafter.fc.weight, runs[1].drafter.fc.weight, atol=1e-5, rtol=0)


def test_resume_reproduces_the_uninterrupted_run(target, seqs, tmp_path):
    cfg = _cfg(batch=2, steps=6, anchors_per_seq=5, markov_head_type="rnn", warmup_steps=2)
    data = ListSource(seqs)
    kw = dict(progress=False, save_every=1000)
    straight = Trainer.start(target, data, cfg, tmp_path / "a", **kw).train(max_steps=4)
    first = Trainer.start(target, data, cfg, tmp_path / "b", **kw)
    first.train(max_steps=2)  # saves step-0000002 when it stops
    emb = (target.embed_tokens.weight, target.lm_head.weight)
    resumed = Trainer.resume(tmp_path / "b", emb, data, cfg, **kw)
    assert resumed.step_idx == 2
    rest = resumed.train(max_steps=2)
    assert [s.loss for s in rest] == pytest.approx([s.loss for s in straight[2:]], abs=1e-6, rel=0)
    # the exported drafter loads as an ordinary DeepSpec checkpoint
    out = resumed.export(tmp_path / "final")
    d = load_drafter(out, embeddings=emb)
    assert d.cfg.markov_head_type == "rnn" and json.loads((out / "training.json").read_text())["step"] == 4
    with pytest.raises(ConfigError, match="already holds a run"):
        Trainer.start(target, data, cfg, tmp_path / "b", **kw)


def test_resume_with_a_different_config_names_the_fields(target, seqs, tmp_path):
    cfg = _cfg(batch=1, steps=3)
    Trainer.start(target, ListSource(seqs), cfg, tmp_path / "r", progress=False).train(max_steps=1)
    other = TrainConfig.from_dict({**cfg.to_dict(), "lr": 1e-4, "anchors_per_seq": 7})
    with pytest.raises(ConfigError) as e:
        Trainer.resume(tmp_path / "r", (target.embed_tokens.weight, target.lm_head.weight),
                       Untouchable(seqs, "list"), other)
    assert "lr: checkpoint has 0.003, requested 0.0001" in str(e.value) and "anchors_per_seq" in str(e.value)
    with pytest.raises(ConfigError, match="training data differs"):
        Trainer.resume(tmp_path / "r", (target.embed_tokens.weight, target.lm_head.weight), ListSource(seqs[:2]))
    check_resume_config(cfg, None)
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match="unknown fields"):
        TrainConfig.from_dict({**cfg.to_dict(), "gamma": 5})


def test_markov_rank_budget_is_measured(target):
    cfg = _cfg()
    d = tiny_drafter(target, seed=1, block_size=GAMMA, layer_ids=LAYER_IDS, markov_rank=8, head="vanilla")
    shared = d.embed_tokens.weight.numel() + d.lm_head.weight.numel()
    assert drafter_param_count(target.cfg, cfg) == sum(p.numel() for p in d.parameters()) - shared
    budget = 2 * drafter_param_count(target.cfg, _cfg(markov_rank=40))
    r = max_markov_rank(target.cfg, cfg, budget_bytes=budget)
    assert r == 40


# --- data ------------------------------------------------------------------------------------------


def test_prompt_files(tmp_path):
    bench = DEFAULT_TRAIN_DIR.parent / "bench" / "gsm8k.jsonl"
    for bad in (bench, tmp_path / "bench" / "x.jsonl"):
        with pytest.raises(DataError, match="bench"):
            read_prompts(bad)
    with pytest.raises(DataError, match="bench"):
        load_train_prompts([DEFAULT_TRAIN_DIR / "gsm8k-train.jsonl", bench])
    notjsonl = tmp_path / "a.jsonl"
    notjsonl.write_text('{"question": "ok?"}\n[1, 2\n')
    with pytest.raises(DataError, match=r"a.jsonl:2: not JSON Lines"):
        read_prompts(notjsonl)
    empty = tmp_path / "e.jsonl"
    empty.write_text('{"answer": "42"}\n{"question": ""}\n')
    with pytest.raises(DataError, match="no prompts"):
        read_prompts(empty)
    if DEFAULT_TRAIN_DIR.exists():
        prompts = load_train_prompts(limit=20)
        gsm = [p for p in prompts if p.source == "gsm8k-train"]
        assert len(gsm) == 20 and not any("####" in p.text for p in gsm)  # the question only
        later = load_train_prompts(limit=20, skip=20)  # a held-out set: the next 20 of each file
        assert len(later) == 40 and not {p.text for p in later} & {p.text for p in prompts}
        assert {p.text for p in load_train_prompts(limit=40)} == {p.text for p in prompts + later}
        with pytest.raises(DataError, match="after skipping"):
            load_train_prompts(skip=10_000)
        assert any("\n\n" in p.text for p in prompts if p.source == "alpaca-seed-tasks")  # instruction + input
    assert first_question('**Question:** "How do I sort a list in Python?"\nMore text') == \
        "How do I sort a list in Python?"
    assert first_question("Here is a new request a user might send:\n\nWrite a haiku.") == ""  # a preamble


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    write_tiny_hf_target(root)
    return root


def test_responses_through_the_engine(tiny_bundle, tmp_path):
    """`generate --engine`: the bundle's engine answers as concurrent requests over its slots. A
    greedy response is the target's greedy generation alone, a sampled one what its seed draws
    alone under the same scheduler, a finished one ends in a stop token; the run is resumable."""
    from dspark.runtime import Engine

    engine = Engine.load(tiny_bundle.path, max_seq=256, slots=2)
    prompts = [Prompt("What is 2+2?", "t"), Prompt("Name a color.", "t"), Prompt("Say hi", "t")]
    gcfg = GenerationConfig(temperatures=(0.0, 1.0), max_new_tokens=12, batch=3)
    responder = EngineResponder(engine, "fixed")
    assert generate_responses(responder, prompts, tmp_path / "resp", gcfg, progress=False) == 6
    assert generate_responses(responder, prompts, tmp_path / "resp", gcfg, progress=False) == 0  # resumable
    alone = Engine.load(tiny_bundle.path, max_seq=256)
    for r in read_responses(tmp_path / "resp"):
        assert r["prompt_ids"] == alone.encode(r["prompt"])
        seed = response_seed(gcfg.seed, r["key"])
        solo = alone.generate(r["prompt"], max_new_tokens=12, temperature=r["temperature"], seed=seed,
                              scheduler="none" if r["temperature"] == 0 else "fixed")  # a seed's draws follow its scheduler
        assert r["response_ids"] == solo.token_ids, r["prompt"]
        assert r["finished"] == (solo.finish_reason == "stop")
        if r["finished"]:
            assert r["response_ids"][-1] in alone.manifest.stop_token_ids
    # the engine writes self-prompts too (T = 1, each from its own seed): reproducible by seed
    writer = EngineResponder(Engine.load(tiny_bundle.path, max_seq=512, slots=2), "fixed")  # the template is long
    synth = [synthesize_prompts(writer, prompts, 2, batch=2, max_new_tokens=8, min_chars=1, progress=False, seed=4)
             for _ in range(2)]
    assert synth[0] == synth[1] and len(synth[0]) > 0 and all(p.source.startswith("self:") for p in synth[0])


def test_generate_cache_and_train_from_cache(tiny_hf, tmp_path):
    model, tok = load_generator(tiny_hf)
    prompts = [Prompt("What is 2+2?", "t"), Prompt("Name a color.", "t"), Prompt("Say hi", "t")]
    gcfg = GenerationConfig(temperatures=(0.0, 1.0), max_new_tokens=6, batch=2)
    responder = TransformersResponder(model, tok)
    assert generate_responses(responder, prompts, tmp_path / "resp", gcfg, progress=False) == 6
    assert generate_responses(responder, prompts, tmp_path / "resp", gcfg, progress=False) == 0  # resumable
    recs = read_responses(tmp_path / "resp")
    assert sorted(r["temperature"] for r in recs) == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    loaded = load_target(tiny_hf)
    t = loaded.model
    # greedy responses are the target's own argmax continuation
    r0 = next(r for r in recs if r["temperature"] == 0.0)
    ids = torch.tensor([r0["prompt_ids"] + r0["response_ids"]])
    with torch.inference_mode():
        logits, _ = t.new_cache(1, ids.shape[1]).run(t, ids, 0)
    n = len(r0["prompt_ids"])
    assert logits[0, n - 1:-1].argmax(-1).tolist() == r0["response_ids"]

    fp32 = TorchStates(t, LAYER_IDS)
    assert cache_features(fp32, recs, tmp_path / "cache", batch=2, progress=False) == len(recs)
    assert cache_features(fp32, recs, tmp_path / "cache", progress=False) == 0
    cache, live = FeatureCache(tmp_path / "cache", LAYER_IDS), OnTheFlySource(fp32, recs)
    assert len(cache) == len(live) == len(recs)
    by_key = {r["key"]: i for i, r in enumerate(live.records)}
    for i, e in enumerate(cache.index):
        a, b = cache[i], live[by_key[e["key"]]]
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.response_mask, b.response_mask)
        torch.testing.assert_close(a.features.float(), b.features, atol=2e-3, rtol=2e-3)
        # lm_head(final_hidden) is the target's logits
        torch.testing.assert_close(t.lm_head(a.final_hidden.float()), t.lm_head(b.final_hidden), atol=2e-2, rtol=0)
    with pytest.raises(ConfigError, match="layer_ids"):
        cache_features(TorchStates(t, (0, 1)), recs, tmp_path / "cache", progress=False)
    with pytest.raises(ConfigError, match="compute"):  # an fp32 cache is never extended with bf16 rows
        cache_features(TorchStates(t, LAYER_IDS, "bf16"), recs, tmp_path / "cache", progress=False)
    bf16 = tmp_path / "cache-bf16"
    assert cache_features(TorchStates(t, LAYER_IDS, "bf16"), recs, bf16, batch=2, progress=False) == len(recs)
    for i in range(len(cache)):  # bf16 matmuls, fp32 residual stream: close to the fp32 states
        torch.testing.assert_close(FeatureCache(bf16)[i].features.float(), cache[i].features.float(),
                                   atol=5e-2, rtol=5e-2)
    cfg = _cfg(batch=2, steps=2, mask_token_id=3)
    Trainer.start(t, cache, cfg, tmp_path / "run", progress=False).train()
    # the evaluate command on a run directory and a cache: one JSON line with the table's numbers
    argv = ["evaluate", "--target", str(tiny_hf), "--drafter", str(tmp_path / "run"), "--label", "tiny",
            "--cache", str(tmp_path / "cache"), "--sequences", "4", "--json", str(tmp_path / "eval.jsonl")]
    assert _script().main(argv) == 0
    assert _script().main(argv + ["--first", "2"]) == 0
    row, first2 = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert row["label"] == "tiny" and row["sequences"] == 4 and len(row["acceptance"]) == GAMMA
    assert first2["sequences"] == 2 and first2["ce"] != row["ce"]
    assert 0 <= min(row["acceptance"]) <= max(row["acceptance"]) <= 1 and row["ce"] > 0
    # --draft-vocab K: the drafter scored as `dspark export --draft-vocab K` deploys it
    assert _script().main(argv + ["--draft-vocab", "24"]) == 0
    k24 = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[-1])
    assert k24["draft_vocab"] == 24 and row["draft_vocab"] == 0 and k24["sequences"] == 4
    assert k24["tv"] != row["tv"] and 0 <= min(k24["acceptance"]) <= max(k24["acceptance"]) <= 1

    synth = synthesize_prompts(responder, prompts, 2, batch=2, max_new_tokens=8, min_chars=1, progress=False)
    assert len(synth) <= 2 and all(p.source.startswith("self:") for p in synth)
    with pytest.raises(DataError, match="no usable"):
        OnTheFlySource(fp32, [{**r0, "response_ids": r0["response_ids"][:1]}])


def test_a_held_out_set_shares_no_prompt_with_the_training_data(tiny_hf, tmp_path):
    """`generate --skip N --disjoint-from DATA` answers only prompts DATA never saw."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": q}) + "\n" for q in ["q one?", "q two?", "q three?", "q one?"]))
    gen = ["generate", "--target", str(tiny_hf), "--prompts", str(prompts), "--self-prompts", "0",
           "--temperatures", "0", "--max-new-tokens", "3", "--batch", "2"]
    script = _script()
    assert script.main(gen + ["--data", str(tmp_path / "train"), "--limit", "2"]) == 0
    seen = {r["prompt"] for r in read_responses(tmp_path / "train" / "responses")}
    assert seen == {"q one?", "q two?"}
    assert script.main(gen + ["--data", str(tmp_path / "held"), "--disjoint-from", str(tmp_path / "train")]) == 0
    assert {r["prompt"] for r in read_responses(tmp_path / "held" / "responses")} == {"q three?"}
    # --skip alone is positional: a prompt repeated later in a file comes back (the 4th line);
    # --disjoint-from is what guarantees a held-out set
    assert script.main(gen + ["--data", str(tmp_path / "held2"), "--skip", "2"]) == 0
    assert {r["prompt"] for r in read_responses(tmp_path / "held2" / "responses")} == {"q three?", "q one?"}


# --- training over a draft vocabulary (TrainConfig.draft_vocab; issue 24) ---------------------------


def _grads(drafter, loss) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)))


def _vocab_run(target, seqs, tmp_path, **kw):
    cfg = _cfg(batch=2, **kw)
    trainer = Trainer.start(target, ListSource(seqs[:2]), cfg, tmp_path / "run", progress=False)
    return trainer.drafter, trainer.batch(0), cfg


@pytest.mark.parametrize("head", ["vanilla", "rnn", "dflash"])
def test_draft_vocab_of_the_whole_vocabulary_is_todays_loss(target, seqs, tmp_path, head):
    """K = V (ids 0..V-1): the restricted path (K-row heads, p_t from the full-V normalizer, a
    tail of 0, no CE slot dropped) gives today's loss terms and gradients."""
    kw = dict(markov_rank=0, dflash=True) if head == "dflash" else dict(markov_head_type=head)
    drafter, batch, cfg = _vocab_run(target, seqs, tmp_path, **kw)
    V = drafter.cfg.vocab_size
    today = compute_loss(drafter, batch, cfg)
    full = torch.arange(V)
    cfg_k = TrainConfig.from_dict({**cfg.to_dict(), "draft_vocab": V})
    restricted = compute_loss(drafter, batch, cfg_k, vocab=full)
    for name in ("total", "ce", "tv", "conf", "accept_sum"):
        torch.testing.assert_close(getattr(restricted, name), getattr(today, name), atol=2e-6, rtol=1e-5, msg=name)
    assert int(restricted.ce_dropped) == 0 and today.ce_dropped is None
    g0, g1 = _grads(drafter, today.total), _grads(drafter, restricted.total)
    for name, g in g0.items():
        if g is None:
            assert g1[name] is None, name
        else:
            torch.testing.assert_close(g1[name], g, atol=1e-6, rtol=1e-4, msg=name)
    with pytest.raises(ConfigError, match="draft_vocab is"):
        compute_loss(drafter, batch, cfg_k)  # the ids must be given
    with pytest.raises(ConfigError, match="draft_vocab is 0"):
        compute_loss(drafter, batch, cfg, vocab=full)
    with pytest.raises(ConfigError, match="draft_vocab is -1"):
        _cfg(draft_vocab=-1)


def _brute_force_loss(drafter, batch, cfg, vocab):
    """A plain autograd reference over the whole vocabulary: the draft distribution p_d' of a
    drafter that proposes only the ids in `vocab` (softmax over their logits, zero elsewhere),
    p_t = softmax of the full target logits, L1 = Σ_V |p_d' − p_t| = 2·TV, CE of slots whose
    label is in `vocab`, BCE against c* = 1 − TV."""
    h = draft_block_states(drafter, batch.features, batch.anchors, batch.inputs, batch.positions).flatten(0, 1)
    heads = teacher_forced_heads(drafter, h, batch.prev.flatten(0, 1))  # [N, γ, V] the unrestricted drafter
    B, T = batch.final_hidden.shape[:2]
    bidx = torch.arange(B)[:, None, None].expand_as(batch.positions)
    t_hidden = batch.final_hidden[bidx, batch.positions.clamp(max=T - 1)].flatten(0, 1)
    pt = (t_hidden @ drafter.lm_head.weight.T).softmax(-1)  # [N, γ, V]
    pd = torch.zeros_like(pt).index_copy(-1, vocab, heads.logits[..., vocab].softmax(-1))  # zero outside K
    labels, valid = batch.labels.flatten(0, 1), batch.valid.flatten(0, 1)
    in_k = torch.isin(labels, vocab)
    ce = -torch.log(pd.gather(-1, labels[..., None])[..., 0].clamp_min(1e-30))
    l1 = (pd - pt).abs().sum(-1)
    w = slot_weights(cfg.block_size, cfg.decay)[None] * valid
    wm = lambda x: (w * x).sum() / w.sum()  # noqa: E731
    ce_m = (w * torch.where(in_k, ce, 0.0)).sum() / w.sum()
    total = (ce_m if cfg.dflash else cfg.alpha_ce * ce_m) + (0 if cfg.dflash else cfg.alpha_tv * wm(l1))
    bce = torch.zeros(())
    if heads.confidence_logits is not None:
        cstar = (1 - 0.5 * l1).clamp(0, 1).detach()
        bce = wm(torch.nn.functional.binary_cross_entropy_with_logits(heads.confidence_logits, cstar, reduction="none"))
        total = total + cfg.alpha_conf * bce
    return total, ce_m, wm(l1), bce, int((valid & ~in_k).sum())


@pytest.mark.parametrize("head", ["vanilla", "gated", "dflash"])
def test_draft_vocab_loss_is_the_exact_tv_of_a_drafter_restricted_to_it(target, seqs, tmp_path, head):
    """K < V: loss terms and gradients equal a brute-force full-vocabulary computation where the
    drafter's probability outside the K ids is zero; chunks of 4 rows cross slot boundaries."""
    kw = dict(markov_rank=0, dflash=True) if head == "dflash" else dict(markov_head_type=head)
    drafter, batch, cfg = _vocab_run(target, seqs, tmp_path, **kw)
    V = drafter.cfg.vocab_size
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:V // 3].sort().values
    cfg_k = TrainConfig.from_dict({**cfg.to_dict(), "draft_vocab": len(vocab)})
    ref, ref_ce, ref_l1, ref_bce, ref_dropped = _brute_force_loss(drafter, batch, cfg, vocab)
    assert ref_dropped > 0  # some labels lie outside the K ids
    want = _grads(drafter, ref)
    for chunk in (16, 4):
        DistillLoss.CHUNK = chunk
        try:
            t = compute_loss(drafter, batch, cfg_k, vocab=vocab)
            got = _grads(drafter, t.total)
        finally:
            DistillLoss.CHUNK = 16
        assert t.total.item() == pytest.approx(ref.item(), rel=1e-5)
        assert t.tv.item() == pytest.approx(ref_l1.item(), rel=1e-5)
        assert t.ce.item() == pytest.approx(ref_ce.item(), rel=1e-5)
        assert t.conf.item() == pytest.approx(ref_bce.item(), rel=1e-5, abs=1e-7)
        assert int(t.ce_dropped) == ref_dropped
        for name, g in want.items():
            if g is None:
                assert got[name] is None, name
            else:
                torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-4, msg=name)
    # the Markov rows outside the K ids get no gradient: the exported graph never uses them
    if drafter.markov_head is not None:
        g = got["markov_head.markov_w2.weight"]
        outside = torch.ones(V, dtype=torch.bool).index_fill(0, vocab, False)
        assert bool((g[outside] == 0).all()) and bool((g[vocab] != 0).any())


def test_teacher_vocab_logits_are_the_full_logits_of_the_k_ids():
    g = torch.Generator().manual_seed(0)
    w, hid = torch.randn(300, 16, generator=g), torch.randn(2, 12, 16, generator=g)  # [V, d], [B, T, d]
    positions = torch.tensor([[[0, 1, 2], [5, 6, 7], [6, 7, 8]], [[3, 4, 5], [10, 11, 12], [0, 1, 2]]])  # [B, A, γ]
    valid = torch.ones_like(positions, dtype=torch.bool)
    valid[1, 1, 1:] = False  # past the response: 12 is clamped to T - 1 and not computed
    valid[1, 2] = False  # a padding anchor
    vocab = torch.tensor([0, 7, 8, 100, 299])
    for bf16 in (False, True):
        full = teacher_logits(w, hid[torch.arange(2)[:, None, None], positions.clamp(max=11)].flatten(0, 1), bf16)
        z, lse = teacher_vocab_logits(w, hid, positions, valid, vocab, bf16)
        v = valid.flatten(0, 1)
        torch.testing.assert_close(z[v], full[..., vocab][v], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[v], full.logsumexp(-1)[v], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(z).all() and torch.isfinite(lse).all()  # invalid slots: finite, weight 0


def test_draft_vocab_ce_rule_drops_slots_outside_it():
    """A slot whose label x* is not among the K ids gets CE weight 0: with only the CE term, its
    logits get no gradient and the logged CE is the other slots' only; the TV term still counts
    it; `ce_dropped` counts it."""
    g = torch.Generator().manual_seed(2)
    N, gamma, V = 3, 4, 20
    vocab = torch.tensor([1, 4, 5, 9, 12, 19])
    logits = torch.randn(N, gamma, len(vocab), generator=g).requires_grad_()
    tfull = torch.randn(N, gamma, V, generator=g)
    labels = vocab[torch.randint(0, len(vocab), (N, gamma), generator=g)]
    labels[0, 1], labels[2, 0], labels[1, 3] = 2, 0, 18  # outside the K ids
    valid = torch.ones(N, gamma, dtype=torch.bool)
    valid[1, 3] = False  # invalid anyway: not counted as dropped
    tz, lse = tfull[..., vocab], tfull.logsumexp(-1)
    ce_only = _cfg(markov_rank=0, dflash=True, draft_vocab=len(vocab))  # CE only
    t = draft_losses(logits, None, tz, labels, valid, ce_only, target_lse=lse, vocab=vocab)
    assert int(t.ce_dropped) == 2
    (grad,) = torch.autograd.grad(t.total, [logits])
    dropped = torch.zeros(N, gamma, dtype=torch.bool)
    dropped[0, 1] = dropped[2, 0] = dropped[1, 3] = True
    assert bool((grad[dropped] == 0).all()) and bool((grad[~dropped].abs().sum(-1) > 0).all())
    w = slot_weights(gamma, 4.0)[None] * valid
    ce = -logits.detach().log_softmax(-1).gather(-1, torch.searchsorted(vocab, labels).clamp(max=5)[..., None])[..., 0]
    assert t.ce.item() == pytest.approx(((w * ce)[~dropped].sum() / w.sum()).item(), rel=1e-6)
    # the TV term keeps the dropped slots: their L1 includes the target's mass outside the K ids
    tv = draft_losses(logits, None, tz, labels, valid, _cfg(draft_vocab=len(vocab)), target_lse=lse, vocab=vocab)
    (grad_tv,) = torch.autograd.grad(tv.total, [logits])
    assert bool((grad_tv[0, 1].abs() > 0).any())
    pd = torch.zeros(N, gamma, V).index_copy(-1, vocab, logits.detach().softmax(-1))
    l1 = (pd - tfull.softmax(-1)).abs().sum(-1)
    assert tv.tv.item() == pytest.approx(((w * l1).sum() / w.sum()).item(), rel=1e-5)


def test_train_with_a_draft_vocab_and_export_it(tiny_hf, tmp_path):
    """`train --draft-vocab K` end to end on a tiny target: the run trains over the ids `dspark
    export --draft-vocab K` then picks from the exported checkpoint, logs the dropped CE slots,
    and its checkpoint exports to a bundle whose drafter graphs propose those K ids."""
    from dspark.runtime.tools.cli import main as dspark

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": q}) + "\n" for q in ["What is 2+2?", "Name a color.", "Say hi"]))
    script, data, run, K = _script(), tmp_path / "data", tmp_path / "run", 24
    assert script.main(["generate", "--target", str(tiny_hf), "--data", str(data), "--prompts", str(prompts),
                        "--self-prompts", "0", "--temperatures", "1", "--max-new-tokens", "16", "--batch", "3"]) == 0
    assert script.main(["train", "--target", str(tiny_hf), "--data", str(data), "--run", str(run), "--no-cache",
                        "--draft-vocab", str(K), "--layer-ids", "-1", "1", "2", "--layers", "1", "--markov-rank", "8",
                        "--block-size", str(GAMMA), "--mask-token-id", "3", "--anchors", "8", "--batch", "2",
                        "--steps", "3", "--warmup", "0", "--log-every", "1", "--max-len", "64"]) == 0
    state = torch.load(run / "checkpoints" / "step-0000003" / "trainer_state.pt", weights_only=True)
    assert state["config"]["draft_vocab"] == K and len(state["draft_vocab_ids"]) == K
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert len(log) == 3 and all("ce_dropped" in r and math.isfinite(r["loss"]) for r in log)
    drafter_dir = tmp_path / "drafter"
    assert script.main(["export", "--run", str(run), "--target", str(tiny_hf), "--out", str(drafter_dir),
                        "--dtype", "fp32"]) == 0
    from dspark.export.bundle import draft_vocab

    loaded = load_target(tiny_hf)
    V = loaded.model.cfg.vocab_size
    ids, how = draft_vocab(K, loaded, drafter_dir)  # what `dspark export --draft-vocab K` picks
    assert torch.equal(ids, state["draft_vocab_ids"]) and "most frequent" in how
    bundle = tmp_path / "bundle"
    assert dspark(["export", "--target", str(tiny_hf), "--drafter", str(drafter_dir), "--out", str(bundle),
                   "--draft-vocab", str(K), "--precision", "fp32", "--no-profile"]) == 0
    from dspark.runtime.manifest import Manifest

    assert Manifest.load(bundle).extra["draft_vocab"]["size"] == K
    # a resumed run keeps its ids; resuming with other ids is refused
    data_src = ListSource([])  # never read: the vocabulary check comes first
    with pytest.raises(ConfigError, match="draft vocabulary"):
        Trainer.resume(run, (loaded.model.embed_tokens.weight, loaded.model.lm_head.weight), data_src,
                       vocab=torch.arange(V - K, V))  # without the stop token 2, which the run's ids hold


def test_committed_xz_shards_are_read_and_generation_goes_on_after_them(tiny_hf, tmp_path):
    """A finished shard compressed for committing (`xz -9`) still counts: its prompts are not
    answered again, and new responses go to the next shard number."""
    import lzma

    model, tok = load_generator(tiny_hf)
    responder = TransformersResponder(model, tok)
    gcfg = GenerationConfig(temperatures=(0.0,), max_new_tokens=4, batch=2)
    out = tmp_path / "resp"
    assert generate_responses(responder, [Prompt("What is 2+2?", "t")], out, gcfg, progress=False) == 1
    plain = out / "responses-00000.jsonl"
    (out / "responses-00000.jsonl.xz").write_bytes(lzma.compress(plain.read_bytes(), preset=9))
    plain.unlink()
    first = read_responses(out)
    assert [r["prompt"] for r in first] == ["What is 2+2?"]
    prompts = [Prompt("What is 2+2?", "t"), Prompt("Say hi", "t")]
    assert generate_responses(responder, prompts, out, gcfg, progress=False) == 1
    assert sorted(f.name for f in out.iterdir()) == ["responses-00000.jsonl.xz", "responses-00001.jsonl"]
    assert [r["prompt"] for r in read_responses(out)] == ["What is 2+2?", "Say hi"]


def test_parts_split_the_prompts_between_processes(tiny_hf, tmp_path):
    """`--part i/n`: the parts answer disjoint sets of keys whose union is every key, each in shards
    of its own, and a part run again (a process restarted) answers nothing new."""
    model, tok = load_generator(tiny_hf)
    responder = TransformersResponder(model, tok)
    prompts = [Prompt(f"Question {i}?", "t") for i in range(12)]
    out = tmp_path / "resp"
    written = [generate_responses(responder, prompts, out, GenerationConfig((0.0,), 2, batch=4, part=(i, 2)),
                                  progress=False) for i in (0, 1)]
    assert all(written) and sum(written) == 12
    assert sorted(f.name for f in out.iterdir()) == ["responses-00000-p0.jsonl", "responses-00001-p1.jsonl"]
    assert sorted(r["prompt"] for r in read_responses(out)) == sorted(p.text for p in prompts)
    assert generate_responses(responder, prompts, out, GenerationConfig((0.0,), 2, part=(1, 2)), progress=False) == 0


def test_samples_add_sampled_responses_and_keep_the_keys_already_written(tiny_hf, tmp_path):
    """`--samples N`: N responses a prompt at T > 0, each from its own seed, one at T = 0; sample 0
    keeps the key a response had before samples existed (the committed data's keys), so a run with
    a larger N answers only the new samples."""
    import lzma

    from dspark.export.train_data import PROJECT_ROOT, prompt_key

    committed = sorted((PROJECT_ROOT / "scripts/drafter_data/smollm2/responses").glob("*.xz"))[0]
    rec = json.loads(lzma.open(committed, "rt").readline())
    assert prompt_key(Prompt(rec["prompt"], rec["source"]), rec["temperature"]) == rec["key"]

    model, tok = load_generator(tiny_hf)
    responder = TransformersResponder(model, tok)
    prompts = [Prompt("What is 2+2?", "t"), Prompt("Say hi", "t")]
    out = tmp_path / "resp"
    assert generate_responses(responder, prompts, out, GenerationConfig((0.0, 1.0), 3, batch=4), progress=False) == 4
    assert generate_responses(responder, prompts, out, GenerationConfig((0.0, 1.0), 3, batch=4, samples=3),
                              progress=False) == 4  # samples 1 and 2 at T = 1; T = 0 stays one
    recs = read_responses(out)
    assert sorted((r["prompt"], r["temperature"], r["sample"]) for r in recs) == sorted(
        [(p.text, 0.0, 0) for p in prompts] + [(p.text, 1.0, i) for p in prompts for i in range(3)])
    assert all(r["key"] == prompt_key(Prompt(r["prompt"], "t"), r["temperature"], r["sample"]) for r in recs)
    assert len({response_seed(0, r["key"]) for r in recs}) == len(recs)
    assert generate_responses(responder, prompts, out, GenerationConfig((0.0, 1.0), 3, samples=3), progress=False) == 0
    with pytest.raises(ConfigError, match="samples"):
        generate_responses(responder, prompts, out, GenerationConfig((1.0,), 3, samples=0), progress=False)


def test_a_data_directory_of_another_target_is_refused_before_compute(tiny_hf, tmp_path):
    """generate records the target in DATA/target.json; generate, cache and train with another
    target stop with a message naming both, before loading a model."""
    other = tmp_path / "other"
    write_tiny_hf_target(other, seed=1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "q one?"}) + "\n")
    data = tmp_path / "data"
    script = _script()
    gen = ["generate", "--prompts", str(prompts), "--self-prompts", "0", "--temperatures", "0",
           "--max-new-tokens", "3", "--data", str(data)]
    assert script.main(gen + ["--target", str(tiny_hf)]) == 0
    assert json.loads((data / "target.json").read_text())["target"] == tiny_hf.name
    for argv in (gen + ["--target", str(other)],
                 ["cache", "--target", str(other), "--data", str(data), "--layer-ids", "1", "2"],
                 ["train", "--target", str(other), "--data", str(data), "--run", str(tmp_path / "run"),
                  "--no-cache", "--layer-ids", "1", "2"]):
        with pytest.raises(SystemExit, match="another target"):
            script.main(argv)
    assert not (tmp_path / "run").exists()
    assert len(read_responses(data / "responses")) == 1


def test_engine_states_are_the_deployed_graphs(tiny_bundle, tmp_path):
    """`cache --engine` / `train --no-cache --engine`: the bundle's ONNX Runtime target graph gives
    the torch target's states (an fp32 bundle: equal in the floating-point sense), a row's states
    do not depend on the batch or its padding, a cache records compute "engine" and never takes
    torch rows, and a bundle with other feature layers or of another target is refused."""
    from dspark.export.engine_states import EngineStates

    t = tiny_bundle.target
    states = EngineStates(tiny_bundle.path, threads=1)
    assert states.layer_ids == (-1, 1, 2) and states.compute == "engine"
    tokens = torch.randint(5, t.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    feats, hidden = states.states(tokens)
    ref_f, ref_h = target_states(t, tokens, states.layer_ids)
    torch.testing.assert_close(feats, ref_f, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, ref_h, atol=1e-4, rtol=1e-4)
    alone_f, alone_h = states.states(tokens[1:, :25])  # another batch, another length: the same bits
    assert torch.equal(alone_f[0], feats[1, :25]) and torch.equal(alone_h[0], hidden[1, :25])

    recs = [{"key": f"k{i}", "prompt_ids": tokens[i, :10].tolist(), "response_ids": tokens[i, 10:30 + 5 * i].tolist()}
            for i in range(2)]
    assert cache_features(states, recs, tmp_path / "cache", batch=2, progress=False) == 2
    assert json.loads((tmp_path / "cache" / "cache_meta.json").read_text())["compute"] == "engine"
    cache, live = FeatureCache(tmp_path / "cache", states.layer_ids), OnTheFlySource(states, recs)
    for i, e in enumerate(cache.index):
        seq = live[[r["key"] for r in live.records].index(e["key"])]
        torch.testing.assert_close(cache[i].features.float(), seq.features, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(cache[i].final_hidden.float(), seq.final_hidden, atol=2e-3, rtol=2e-3)
    with pytest.raises(ConfigError, match="target"):
        cache_features(TorchStates(t, states.layer_ids), recs, tmp_path / "cache", progress=False)

    script = _script()
    with pytest.raises(SystemExit, match="emits the features of target layers"):
        script._engine_states(str(tiny_bundle.path), tmp_path, (1, 2), 1)
    (tmp_path / "target.json").write_text(json.dumps({"target": "other.gguf", "sha256": "0" * 64}))
    with pytest.raises(SystemExit, match="serves another target"):
        script._engine_states(str(tiny_bundle.path), tmp_path, None, 1)

    # a run trained on the engine's states, on the fly, and resumed the same way (run.json names the bundle)
    data, run = tmp_path / "data", tmp_path / "run"
    (data / "responses").mkdir(parents=True)
    (data / "responses" / "responses-00000.jsonl").write_text("".join(
        json.dumps({**r, "source": "t", "temperature": 0.0, "prompt": "p", "finished": True}) + "\n" for r in recs))
    argv = ["--target", str(tiny_bundle.target_dir), "--data", str(data), "--run", str(run), "--layer-ids", "-1", "1",
            "2", "--layers", "1", "--markov-rank", "8", "--block-size", "4", "--mask-token-id", "3", "--anchors", "4",
            "--batch", "2", "--steps", "3", "--warmup", "0", "--threads", "1", "--engine", str(tiny_bundle.path)]
    with pytest.raises(SystemExit, match="pass --no-cache"):
        script.main(["train", *argv])
    assert script.main(["train", *argv, "--no-cache", "--max-steps", "2"]) == 0
    assert json.loads((run / "run.json").read_text())["engine"] == str(tiny_bundle.path)
    assert script.main(["resume", "--run", str(run), "--target", str(tiny_bundle.target_dir), "--threads", "1"]) == 0
    assert (run / "checkpoints" / "step-0000003").is_dir()

    # scripts/bench_target_states.py on the same data: the three sources, and an fp32 bundle's states are the torch ones
    import re
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "scripts" / "bench_target_states.py"),
                           "--engine", str(tiny_bundle.path), "--data", str(data), "--target",
                           str(tiny_bundle.target_dir), "--sequences", "2", "--batch", "2", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {m[1]: m for m in re.finditer(r"^(engine|torch fp32|torch bf16) .*$", done.stdout, re.M)}
    assert set(rows) == {"engine", "torch fp32", "torch bf16"}
    fp32 = re.search(r"features ([0-9.]+), final hidden ([0-9.]+)", rows["torch fp32"][0])
    assert float(fp32[1]) < 1e-3 and float(fp32[2]) < 1e-3
