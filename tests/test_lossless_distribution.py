"""Distributional losslessness at temperature 1, end to end (dspark.md §1, step 7).

A tiny target and a tiny drafter over a 5-token vocabulary, made to disagree
(total variation ≥ 0.3 at the verified slots), so that a wrong acceptance rule
shows in the output distribution.

1. Exact: the target's joint distribution of the first K = 3 generated tokens is
   enumerated (125 cells). A second enumerator follows the speculative process —
   draft tokens from the drafter's exact per-slot distributions (which depend on
   earlier drafts through the sequential head), the scheduler's ℓ, acceptance
   outcomes and emitted tokens, cycle after cycle until K tokens are out — and is
   parametrised by the rule's two functions (`accept_probabilities`, `residual`).
   With the rule of `dspark.runtime.sampling` it reproduces the target's joint to
   1e-9; with a deliberately broken rule it does not.
2. Wiring: `generate()` is replayed draw for draw (its RNG protocol: one uniform
   for the prefill token, then 2γ+1 per cycle — γ for drafting, γ for acceptance,
   one for the emitted token) from the same exact tables.
3. Sampling: N seeded `generate()` runs, chi-square against the exact target joint
   at α = 1e-4. N is the smallest size at which the test rejects each broken rule's
   exact distribution with probability ≥ 0.99 (non-central chi-square power), and
   the broken rules, patched into the runtime, are shown to be rejected.
4. The exported engine: the same pair over 5 ids exported at `--precision int8|int4`,
   whose ONNX Runtime graph (int8 activations) is the target; its joint is computed
   from the graph itself, and a broken residual is shown to be rejected at that N.

Generation runs to MAX_NEW = γ + 2 tokens although only the first K = 3 are
histogrammed: with max_new_tokens = 3 the budget would cap the first cycle at
ℓ ≤ 1, and neither the sequential head's second slot nor a bonus after two
accepts would be exercised.
"""
from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest
import torch
from factories import tiny_drafter, tiny_target
from rules import accept_probability, residual, sample_from, softmax
from scipy import stats

import dspark.runtime.sampling as sampling
from dspark.export import DraftSession, TorchBackend
from dspark.runtime import (Calibration, FixedLength, Request, SamplingParams, SpsTable, StaticThreshold, generate,
                            generate_batch)
from dspark.runtime.schedulers import make_scheduler
from dspark.runtime.schedulers import History

V, GAMMA, K = 5, 2, 3
MAX_NEW = GAMMA + 2  # the first cycle may verify all γ slots
PROMPT = [1, 4, 0, 2]
ALPHA = 1e-4
MIN_POWER = 0.99
THRESHOLD = 0.6  # sigmoid(c_k) values of this model sit on both sides of it (checked below)
# The smallest multiples of 10 with power >= 0.99 against both broken rules
# (test_sample_size_has_power re-derives them); one generate() call takes about 3 ms.
N_SAMPLES = {"fixed": 220, "threshold": 200}
SCHEDULERS = {"fixed": FixedLength(), "threshold": StaticThreshold(THRESHOLD)}


# ----- broken rules: each is a plausible implementation mistake ----------------------------

def residual_is_target(xp, p_t: np.ndarray, p_d: np.ndarray) -> np.ndarray:
    """After a rejection, draw from p_t instead of norm(max(0, p_t - p_d))."""
    return p_t


def accept_without_ratio(xp, p_t: np.ndarray, p_d: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """Accept with probability p_t(x) instead of min(1, p_t(x) / p_d(x))."""
    return xp.take_along_axis(p_t, drafts[..., None], -1)[..., 0]


CORRECT = (sampling.accept_probabilities, sampling.residual)
BROKEN = {"residual=p_t": (sampling.accept_probabilities, residual_is_target),
          "accept=p_t(x)": (accept_without_ratio, sampling.residual)}


# ----- the models and their exact tables -------------------------------------------------

def build_models():
    torch.manual_seed(0)
    target = tiny_target("llama", seed=0, vocab=V, hidden=32, layers=2, heads=4, kv_heads=2)
    drafter = tiny_drafter(target, seed=11, block_size=GAMMA, layer_ids=(-1, 0), markov_rank=4, head="rnn")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # peaked target
        # the drafter gets its own LM head, so that it disagrees with the target
        drafter.lm_head.weight.copy_(4.0 * torch.randn(drafter.lm_head.weight.shape, generator=g) / 32 ** 0.5)
    return target, drafter


class Tables:
    """Exact distributions, computed one prefix at a time and cached.

    p_t(gen): the target's next-token distribution (T = 1, float64) after PROMPT + gen.
    slots(out): for a cycle whose committed output is `out` (anchor = out[-1]), a map
    from each draft prefix d_1..d_{k-1} to (p_d,k normalised in float64, raw confidence
    logit c_k), obtained with forced draft tokens."""

    def __init__(self, target, drafter):
        self.target, self.drafter = target, drafter
        self.session = DraftSession(drafter, 32)
        self._pt: dict[tuple, np.ndarray] = {}
        self._slots: dict[tuple, dict] = {}

    @torch.inference_mode()
    def _forward(self, seq: list[int]):
        cache = self.target.new_cache(1, 32)
        logits, feats = cache.run(self.target, torch.tensor([seq]), 0, self.drafter.cfg.target_layer_ids)
        return logits[0].numpy(), feats[0].numpy()

    def p_t(self, gen: tuple) -> np.ndarray:
        if gen not in self._pt:
            self._pt[gen] = softmax(self._forward(PROMPT + list(gen))[0][-1], 1.0)
        return self._pt[gen]

    def slots(self, out: tuple) -> dict:
        if out not in self._slots:
            ctx = PROMPT + list(out[:-1])
            feats = self._forward(ctx)[1]
            table = {}
            for prefix in itertools.product(range(V), repeat=GAMMA - 1):
                self.session.reset()
                r = self.session.draft(feats, out[-1], len(ctx), 1.0, forced_tokens=list(prefix) + [0])
                for k in range(GAMMA):  # slot k+1 depends on the forced tokens before it only
                    p = r.probs[k].astype(np.float64)
                    table[prefix[:k]] = (p / p.sum(), float(r.confidence_logits[k]))
            self._slots[out] = table
        return self._slots[out]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models():
    return build_models()


@pytest.fixture(scope="module")
def tables(models):
    return Tables(*models)


# ----- exact enumerators -------------------------------------------------------------------

def target_joint(tables: Tables) -> np.ndarray:
    joint = np.zeros((V,) * K)
    for cell in itertools.product(range(V), repeat=K):
        joint[cell] = np.prod([tables.p_t(cell[:i])[cell[i]] for i in range(K)])
    return joint


def scheduled_length(scheduler, table: dict, drafts: tuple, out_len: int, max_new: int) -> int:
    conf = np.array([table[drafts[:k]][1] for k in range(GAMMA)], dtype=np.float32)
    return min(int(scheduler.lengths(conf[None], History(deque()))[0]), max_new - out_len - 1)  # as generate() caps it


def speculative_joint(tables: Tables, rule, scheduler, max_new: int = MAX_NEW) -> tuple[np.ndarray, np.ndarray]:
    """Exact joint of the first K emitted tokens of the speculative process with
    rule = (accept_probabilities, residual) of dspark.runtime.sampling or a broken variant, and the distribution of the first cycle's ℓ."""
    accept, resid = rule
    joint = np.zeros((V,) * K)
    first_ell = np.zeros(GAMMA + 1)

    def cycle(out: tuple, w: float) -> None:
        if len(out) >= K:
            joint[out[:K]] += w
            return
        table = tables.slots(out)
        for drafts in itertools.product(range(V), repeat=GAMMA):
            p_d = [table[drafts[:k]][0] for k in range(GAMMA)]
            mass = w * np.prod([p_d[k][drafts[k]] for k in range(GAMMA)])
            if mass == 0.0:
                continue
            ell = scheduled_length(scheduler, table, drafts, len(out), max_new)
            if len(out) == 1:
                first_ell[ell] += mass
            for k in range(ell + 1):  # mass = P(reach slot k+1 with d_1..d_k accepted)
                seq = out + drafts[:k]
                if len(seq) >= K:  # the first K tokens are already fixed
                    joint[seq[:K]] += mass
                    break
                p_t = tables.p_t(seq)
                if k == ell:  # all ℓ accepted: the bonus token
                    for x in range(V):
                        cycle(seq + (x,), mass * p_t[x])
                    break
                a = accept_probability(p_t, p_d[k], drafts[k], rule=accept)
                if a < 1.0:  # rejected at slot k+1: one token from the residual, cycle ends
                    r = residual(p_t, p_d[k], rule=resid)
                    r = r / r.sum()  # sample_from draws proportionally
                    for x in range(V):
                        cycle(seq + (x,), mass * (1.0 - a) * r[x])
                mass *= a
                if mass == 0.0:
                    break

    p0 = tables.p_t(())
    for x in range(V):
        cycle((x,), p0[x])
    return joint, first_ell


# ----- chi-square machinery ----------------------------------------------------------------

def merge_cells(p: np.ndarray, n: int) -> list[np.ndarray]:
    """Cells with expected count n·p >= 5 stand alone; the rest are pooled into one cell,
    topped up with the smallest other cells until its expected count is >= 5."""
    p = p.ravel()
    order = np.argsort(p, kind="stable")
    small = [i for i in order if n * p[i] < 5]
    groups = [[i] for i in order if n * p[i] >= 5]
    if small:
        pool = list(small)
        while n * p[pool].sum() < 5 and groups:
            pool += groups.pop(0)
        groups.append(pool)
    return [np.array(g) for g in groups]


def grouped(x: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    x = x.ravel()
    return np.array([x[g].sum() for g in groups])


def power(p: np.ndarray, q: np.ndarray, n: int) -> float:
    """P(the chi-square test at ALPHA rejects p, on n samples drawn from q)."""
    groups = merge_cells(p, n)
    pg, qg = grouped(p, groups), grouped(q, groups)
    df = len(groups) - 1
    return float(stats.ncx2.sf(stats.chi2.ppf(1 - ALPHA, df), df, n * np.sum((qg - pg) ** 2 / pg)))


def chi_square_pvalue(p: np.ndarray, counts: np.ndarray) -> float:
    n = int(counts.sum())
    groups = merge_cells(p, n)
    expected, observed = n * grouped(p, groups), grouped(counts, groups)
    stat = float(np.sum((observed - expected) ** 2 / expected))
    return float(stats.chi2.sf(stat, len(groups) - 1))


def reference(models) -> TorchBackend:
    return TorchBackend(*models, max_seq=32)


def sample_histogram(backend, scheduler, n: int) -> tuple[np.ndarray, set[int]]:
    counts = np.zeros((V,) * K)
    lengths: set[int] = set()
    for seed in range(n):
        g = generate(backend, PROMPT, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=seed),
                     scheduler)
        counts[tuple(g.token_ids[:K])] += 1
        lengths.update(g.stats.verified)
    return counts, lengths


# ----- tests -------------------------------------------------------------------------------

def test_target_and_drafter_disagree(tables):
    """The slots that matter have TV >= 0.3 on average, and no p_d is near the 1e-8 floor."""
    p0 = tables.p_t(())
    tv1 = tv2 = 0.0
    for x0 in range(V):
        table = tables.slots((x0,))
        p_d1 = table[()][0]
        tv1 += p0[x0] * 0.5 * np.abs(p_d1 - tables.p_t((x0,))).sum()
        for d1 in range(V):
            tv2 += p0[x0] * p_d1[d1] * 0.5 * np.abs(table[(d1,)][0] - tables.p_t((x0, d1))).sum()
    assert tv1 >= 0.3, f"slot 1 of the first cycle: expected TV {tv1:.3f}"
    assert tv2 >= 0.3, f"slot 2 of the first cycle: expected TV {tv2:.3f}"
    assert p0.max() < 0.9, "the first token should not be nearly deterministic"
    for out in itertools.product(range(V), repeat=2):
        for p_d, _ in tables.slots(out).values():
            assert p_d.min() > 1e-6  # the floors in accept_probability never bind: the rule is exact here


def test_threshold_varies_the_verified_length(tables):
    _, first_ell = speculative_joint(tables, CORRECT, SCHEDULERS["threshold"])
    assert np.all(first_ell > 0.05), f"P(ℓ) in the first cycle: {first_ell}"
    margin = min(abs(1 / (1 + np.exp(-c)) - THRESHOLD)
                 for out in itertools.chain(itertools.product(range(V), repeat=1),
                                            itertools.product(range(V), repeat=2))
                 for _, c in tables.slots(out).values())
    assert margin > 1e-3, "a confidence this close to the threshold could flip ℓ between runs"


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_exact_enumeration_reproduces_the_target(tables, sched):
    p = target_joint(tables)
    q, _ = speculative_joint(tables, CORRECT, SCHEDULERS[sched])
    assert abs(p.sum() - 1) < 1e-12 and abs(q.sum() - 1) < 1e-12
    np.testing.assert_allclose(q, p, rtol=0, atol=1e-9)
    for name, rule in BROKEN.items():
        q_bad, _ = speculative_joint(tables, rule, SCHEDULERS[sched])
        assert abs(q_bad.sum() - 1) < 1e-12
        assert 0.5 * np.abs(q_bad - p).sum() > 0.05, f"{name} should change the output distribution"


def replay(tables: Tables, seed: int, scheduler) -> tuple[list[int], list[int]]:
    """generate() redone from the exact tables with the same draws: (tokens, ℓ per cycle)."""
    rng = np.random.default_rng(seed)
    out = [sample_from(tables.p_t(()), rng.random())]
    verified = []
    while len(out) < MAX_NEW:
        u = rng.random(2 * GAMMA + 1)
        table = tables.slots(tuple(out))
        drafts: tuple = ()
        for k in range(GAMMA):
            drafts += (sample_from(table[drafts][0], u[k]),)
        ell = scheduled_length(scheduler, table, drafts, len(out), MAX_NEW)
        verified.append(ell)
        for k in range(ell + 1):
            p_t = tables.p_t(tuple(out) + drafts[:k])
            if k == ell:
                out += list(drafts[:k]) + [sample_from(p_t, u[2 * GAMMA])]
                break
            p_d = table[drafts[:k]][0]
            if u[GAMMA + k] >= accept_probability(p_t, p_d, drafts[k]):
                out += list(drafts[:k]) + [sample_from(residual(p_t, p_d), u[2 * GAMMA])]
                break
    return out[:MAX_NEW], verified


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_generate_follows_the_rng_protocol(models, tables, sched):
    backend = reference(models)
    for seed in range(40):
        g = generate(backend, PROMPT, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=seed),
                     SCHEDULERS[sched])
        tokens, verified = replay(tables, seed, SCHEDULERS[sched])
        assert (g.token_ids, g.stats.verified) == (tokens, verified), f"seed {seed}"


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_sample_size_has_power(tables, sched):
    """At N_SAMPLES[sched] every broken rule is rejected with probability >= 0.99, and N is
    (about) the smallest such size, so the sampling test stays fast."""
    p = target_joint(tables)
    n = N_SAMPLES[sched]
    broken = {name: speculative_joint(tables, rule, SCHEDULERS[sched])[0] for name, rule in BROKEN.items()}
    for name, q in broken.items():
        assert power(p, q, n) >= MIN_POWER, f"{name}: power {power(p, q, n):.4f} at N = {n}"
    smallest = min(m for m in range(10, n + 1, 10) if all(power(p, q, m) >= MIN_POWER for q in broken.values()))
    assert n <= smallest + 20, f"N = {n} is larger than needed ({smallest} has enough power)"


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_generate_matches_the_target_distribution(models, tables, sched):
    counts, lengths = sample_histogram(reference(models), SCHEDULERS[sched], N_SAMPLES[sched])
    pvalue = chi_square_pvalue(target_joint(tables), counts)
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}: the output is not the target's distribution"
    if sched == "threshold":
        assert lengths >= {0, 1, 2}, f"verified lengths seen: {sorted(lengths)}"
    else:
        assert GAMMA in lengths


@pytest.mark.parametrize("broken", list(BROKEN))
def test_chi_square_rejects_a_broken_rule(models, tables, broken, monkeypatch):
    """The same test, run on generate() with a broken rule patched in, rejects it."""
    accept, resid = BROKEN[broken]
    monkeypatch.setattr(sampling, "accept_probabilities", accept)
    monkeypatch.setattr(sampling, "residual", resid)
    counts, _ = sample_histogram(reference(models), SCHEDULERS["fixed"], N_SAMPLES["fixed"])
    pvalue = chi_square_pvalue(target_joint(tables), counts)
    assert pvalue < ALPHA, f"{broken}: chi-square p = {pvalue:.2e}, the broken rule went unnoticed"


# ----- four requests at once under the default scheduler -------------------------------------

R4 = 4
N_R4 = 400  # more than the single-request tests need against the broken rules
# Padded verification of 4 rows: B = 4·(1 + max ℓ) ∈ {4, 8, 12}; this curve makes Algorithm 1
# choose every length from 0 to γ (checked below).
R4_TABLE = SpsTable((1, 1, 1, 1, .95, .93, .9, .88, .87, .87, .87, .87))
# For `cost`: a drafter pass as dear as 0.8 one-token steps, so the gate skips about 2 steps in 3.
R4_TABLES = {"auto": R4_TABLE, "async": R4_TABLE, "cost": SpsTable(R4_TABLE.sps, (0.8,) * R4)}


@pytest.mark.parametrize("name", list(R4_TABLES))
def test_four_requests_at_once_match_the_target_distribution(models, tables, name):
    """Each request's first K tokens, with 4 requests sharing every drafter and verification pass
    under the default scheduler (`auto`: Algorithm 1 when the bundle has an SPS table and a
    calibration; `cost` when the table also has the drafter's cost, as `dspark profile` writes
    it), its asynchronous variant and the cost-aware one (which also skips the drafter for
    whole steps), follow the target's distribution."""
    scheduler = make_scheduler(name, sps=R4_TABLES[name], calibration=Calibration.identity(GAMMA))
    assert scheduler.name == {"auto": "prefix"}.get(name, name)
    backend = TorchBackend(*models, max_seq=32, slots=R4)
    requests = [Request(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=s)) for s in range(N_R4)]
    gens = generate_batch(backend, requests, scheduler)
    counts = np.zeros((V,) * K)
    for g in gens:
        counts[tuple(g.token_ids[:K])] += 1
    lengths = [ell for g in gens for ell in g.stats.verified]
    assert {ell: lengths.count(ell) > 50 for ell in range(GAMMA + 1)} == dict.fromkeys(range(GAMMA + 1), True), (
        f"verified lengths should vary: {np.bincount(lengths)}")
    assert max(b for g in gens for b in g.stats.batch) == R4
    if name == "cost":
        drafted, cycles = sum(sum(g.stats.drafted) for g in gens), sum(g.stats.cycles for g in gens)
        assert 0.1 * cycles < drafted < 0.9 * cycles, f"{drafted} of {cycles} steps drafted"
    pvalue = chi_square_pvalue(target_joint(tables), counts)
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}: the output is not the target's distribution"


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_target_distribution(precision, tmp_path):
    """The same test with the target's weights quantized as `dspark export --precision` does
    (the torch reference of the quantized target: the dequantized weights, fp32 arithmetic)."""
    from dspark.export.precision import dequantize_into, target_weights

    target, drafter = build_models()
    before = target.layers[0].mlp.down_proj.weight.detach().clone()
    dequantize_into(target, target_weights(target, tmp_path, precision))
    assert not torch.equal(before, target.layers[0].mlp.down_proj.weight)
    tables = Tables(target, drafter)
    counts, _ = sample_histogram(reference((target, drafter)), SCHEDULERS["fixed"], N_SAMPLES["fixed"])
    pvalue = chi_square_pvalue(target_joint(tables), counts)
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e} at {precision}: not the target's distribution"


# ----- the exported quantized graph as the target ----------------------------------------

N_GRAPH = 400  # seeded generate() runs on the exported engine (chi-square against its own joint)


def write_five_token_pair(root) -> tuple:
    """A Hugging Face directory of a target over V = 5 ids (2 layers, hidden 32, the LM head
    scaled by 4 as in build_models: a peaked target) with a 5-token tokenizer, and a DeepSpec
    drafter checkpoint for it whose Markov bias repeats the anchor (it disagrees with the target)."""
    from factories import copy_drafter, randomize
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dspark.export import load_target, save_drafter

    target_dir, drafter_dir = root / "target", root / "drafter"
    tokens = ["<s>", "<|im_end|>", "a", "b", "c"]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)},
                                                                              unk_token="<s>")),
                                  bos_token="<s>", eos_token="<|im_end|>", unk_token="<s>")
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=0,
                      eos_token_id=1, tie_word_embeddings=False)
    model = randomize(LlamaForCausalLM(cfg), 0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    save_drafter(copy_drafter(load_target(target_dir).model, block_size=GAMMA, boost=3.0, layer_ids=(-1, 0)), drafter_dir)
    return target_dir, drafter_dir


class GraphTables:
    """The exported target's next-token distributions (T = 1, float64) after PROMPT + gen, for
    `target_joint`, each from one prefill of the prefix: the graph scores a row with the same bits
    in any call (test_ort_runtime.py), so these are the numbers generation sees."""

    def __init__(self, backend):
        self.backend, self._pt = backend, {}

    def p_t(self, gen: tuple) -> np.ndarray:
        if gen not in self._pt:
            logits, _ = self.backend.prefill(0, np.asarray(PROMPT + list(gen), np.int64), ingest=False)
            self._pt[gen] = softmax(logits.astype(np.float64), 1.0)
        return self._pt[gen]


@pytest.fixture(scope="module", params=["int8", "int4"])
def exported_quantized(request, tmp_path_factory):
    """The five-token pair exported at `--precision int8|int4`: the ONNX Runtime graph with
    MatMulNBits and int8 activations, an arithmetic of its own, is the target."""
    import warnings

    from dspark.export.bundle import export_bundle
    from dspark.runtime import Engine

    root = tmp_path_factory.mktemp(f"five_{request.param}")
    target_dir, drafter_dir = write_five_token_pair(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_bundle(root / "bundle", target_dir, drafter_dir, progress=False, quick_profile=False,
                      precision=request.param)
    engine = Engine.load(root / "bundle", max_seq=32)
    assert engine.manifest.precision == request.param
    return engine.backend, target_joint(GraphTables(engine.backend))


def test_exported_quantized_graph_distribution(exported_quantized):
    """Sampled DSpark on the exported int8/int4 engine draws the first K tokens from that
    graph's own distribution decoding alone (its int8 activations included)."""
    backend, joint = exported_quantized
    pvalue = chi_square_pvalue(joint, sample_histogram(backend, SCHEDULERS["fixed"], N_GRAPH)[0])
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}: not the exported graph's distribution"


def test_exported_quantized_graph_test_has_power(exported_quantized, monkeypatch):
    """The same check rejects a broken residual on this engine, so the test above can fail."""
    backend, joint = exported_quantized
    monkeypatch.setattr(sampling, "residual", residual_is_target)
    pvalue = chi_square_pvalue(joint, sample_histogram(backend, SCHEDULERS["fixed"], N_GRAPH)[0])
    assert pvalue < ALPHA, f"residual=p_t: chi-square p = {pvalue:.2e}, the broken rule went unnoticed"
