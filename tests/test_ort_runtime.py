"""The exported bundle served by ONNX Runtime matches the PyTorch reference (tiny random model).

Step level: prefill, verification and drafting rounds of `OrtBackend` against `TorchBackend`
on the same target and drafter. Loop level: `Engine.generate` against `dspark.runtime.core`
on `TorchBackend`, greedy and sampled. Plus the lean runtime without torch, streaming, stop
strings and the preallocated KV buffers."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from factories import assert_rows_invariant, import_blocker, reference_logits, step_batch

from dspark.export import TorchBackend
from dspark.runtime import Engine, FixedLength, SamplingParams, StaticThreshold, generate
from dspark.runtime.manifest import Manifest
from dspark.runtime.backends.onnxruntime import OrtBackend
from dspark.runtime.tools.parity import greedy_match

PROMPT = "Hello there, how are you?"
PROMPTS = [PROMPT, "What is 17 * 23?", "Tell me a story about a dragon."]
MAX_SEQ = 256
TOL = 1e-4


@pytest.fixture(scope="module")
def manifest(tiny_bundle):
    return Manifest.load(tiny_bundle.path)


@pytest.fixture(scope="module")
def engine(tiny_bundle):
    """The exported fp32 drafter: the torch reference must match it to TOL (the int8 drafter
    has its own test below)."""
    return Engine.load(tiny_bundle.path, max_seq=MAX_SEQ, drafter_graph="fp32")


def close(a, b, what, tol=TOL):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    err = float(np.abs(a - b).max()) if a.size else 0.0
    assert err <= tol, f"{what}: max |ORT - torch| = {err:.3g} > {tol}"


# --- step level -----------------------------------------------------------------------------------

@pytest.mark.parametrize("graph", ["ort", "portable"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_steps_match_torch_reference(tiny_bundle, manifest, engine, temperature, graph):
    """prefill → draft → verify (S = γ+1) → draft → verify, same inputs and uniforms on both,
    for both target graphs (the ONNX Runtime variant writes its cache in place)."""
    gamma = manifest.drafter.block_size
    ids = np.asarray(engine.encode(PROMPT), np.int64)
    n = len(ids)
    ort_be = OrtBackend(tiny_bundle.path, manifest, 128, target_graph=graph, drafter_graph="fp32")
    assert ort_be.in_place == (graph == "ort")
    ref_be = TorchBackend(tiny_bundle.target, tiny_bundle.drafter, 128)
    assert ort_be.block_size == ref_be.block_size == gamma

    lo, fo = ort_be.target(ids[None], np.zeros(1, np.int64))  # every prompt row
    lr, fr = ref_be.target(ids[None], np.zeros(1, np.int64))
    close(lo, lr, "prompt logits")
    close(fo, fr, "prompt features")
    assert fo.shape == (1, n, manifest.drafter.feature_dim)
    lo1, fo1 = ort_be.prefill(0, ids, True)  # the loop's call: last row only (rewrites the same KV rows)
    lr1, fr1 = ref_be.prefill(0, ids, True)  # and feeds the drafter rows 0..n-2
    close(lo1, lr[0, -1], "prefill last-row logits")
    close(lo1, lr1, "prefill logits")
    close(fo1, fr1, "prefill features")
    assert fo1.shape == (1, manifest.drafter.feature_dim)

    rng = np.random.default_rng(123)
    anchor, start, ctx_start = int(np.argmax(lr1)), n, n - 1
    ctx_o, ctx_r = fo1, fr1  # each backend drafts from its own features, as in the loop
    accepted = [1, gamma]  # commit a partial, then a full prefix: both cache cut-backs are exercised
    one = np.ones(1, np.int64)
    for round_, a in enumerate(accepted):
        u = rng.random((1, gamma))
        args = (np.array([len(ctx_o)]), np.array([ctx_start]), np.array([anchor]), np.array([temperature]), u)
        do = ort_be.draft(step_batch(ctx_o[None], *args))
        dr = ref_be.draft(step_batch(ctx_r[None], *args))
        where = f"round {round_} (T={temperature})"
        assert do.tokens.tolist() == dr.tokens.tolist(), f"{where}: draft tokens"
        close(do.probs, dr.probs, f"{where}: draft probs")
        close(do.confidence_logits, dr.confidence_logits, f"{where}: confidence logits")
        assert np.allclose(do.probs.sum(-1), 1.0, atol=1e-5)
        if temperature == 0:  # one-hot at the drafted token
            assert (do.probs.argmax(-1) == do.tokens).all() and (do.probs.max(-1) == 1.0).all()

        block = np.concatenate([[anchor], dr.tokens[0]]).astype(np.int64)[None]  # [1, γ + 1]
        lo, fo = ort_be.target(block, start * one)
        lr, fr = ref_be.target(block, start * one)
        close(lo, lr, f"{where}: verify logits")
        close(fo, fr, f"{where}: verify features")
        assert (lo.argmax(-1) == lr.argmax(-1)).all()
        ctx_o, ctx_r, ctx_start = fo[0, :a + 1], fr[0, :a + 1], start
        start, anchor = start + a + 1, int(np.argmax(lr[0, a]))


def test_target_rows_are_invariant_to_the_call(tiny_bundle):
    """Verifying S tokens scores each exactly as decoding it would, and a batch of slots scores
    each as alone: greedy speculation and batching are then token-identical to the target alone,
    not only up to near-ties."""
    assert_rows_invariant(Engine.load(tiny_bundle.path, max_seq=MAX_SEQ, slots=2), PROMPTS)


@pytest.mark.parametrize("arch, kw", [("qwen3", dict(heads=4, kv_heads=2, head_dim=24)),  # q/k norm, odd /16
                                      ("qwen3", dict(heads=2, kv_heads=2, head_dim=40, tie=True)),  # MHA: G = 1
                                      ("llama", dict(heads=4, kv_heads=1))])  # one KV head
def test_ort_graph_attention_on_other_shapes(arch, kw):
    """The ONNX Runtime graph's attention for other head layouts than the tiny bundle's: against
    the torch reference (a prompt, then 3 rows at once), and each of the 3 rows scored in a call
    of 2 (a lone row may take other kernels on some CPUs: the backend pads it, see min_rows)."""
    import onnxruntime as ort
    import torch
    from factories import tiny_target

    from dspark.export.ort_graph import build_target_ort
    from dspark.runtime.backends.onnxruntime import session_options

    target = tiny_target(arch, seed=5, **kw)
    c = target.cfg
    with torch.no_grad():
        sess = ort.InferenceSession(build_target_ort(target, (0,)).SerializeToString(), session_options(1))
    cache = {f"past_{kv}_{i}": np.zeros((1, c.num_kv_heads, 64, c.head_dim), np.float32)
             for kv in ("key", "value") for i in range(c.num_layers)}

    def run(tokens: np.ndarray, start: int) -> np.ndarray:  # tokens [S] -> logits [S, V]; keeps the cache
        out = sess.run(None, {"input_ids": tokens[None], "logit_index": np.arange(len(tokens))[None],
                              "starts": np.array([start]), "key_count": np.array([start + len(tokens)]), **cache})
        names = [o.name for o in sess.get_outputs()]
        cache.update({n.replace("present", "past"): v for n, v in zip(names, out) if n.startswith("present")})
        return out[0][0]

    ids = np.random.default_rng(0).integers(0, c.vocab_size, 13)
    ref, _ = TorchBackend(target, None, 64).target(ids[None, :12], np.zeros(1, np.int64))  # [1, 12, V]
    run(ids[:9], 0)
    three = run(ids[9:12], 9)
    close(three, ref[0, 9:], f"{arch} {kw}")
    for j in range(3):
        assert np.array_equal(run(ids[9 + j:11 + j], 9 + j)[0], three[j]), f"row {j} in a call of 2"


def test_ort_graph_prompt_near_the_context_limit():
    """A prompt of nearly max_position_embeddings tokens in one call: RotaryEmbedding bounds its
    input's sequence axis by the cos/sin cache, so q must be rotated per token (S rows), never as
    the S·G attention rows (which exceed it here). Against the torch reference."""
    import onnxruntime as ort
    import torch
    from factories import tiny_target

    from dspark.export.ort_graph import build_target_ort
    from dspark.runtime.backends.onnxruntime import session_options

    target = tiny_target("llama", seed=5)
    c = target.cfg
    n = c.max_position_embeddings - 12  # S·G > max_position_embeddings
    assert n * (c.num_heads // c.num_kv_heads) > c.max_position_embeddings
    with torch.no_grad():
        sess = ort.InferenceSession(build_target_ort(target, (0,)).SerializeToString(), session_options(1))
    cache = {f"past_{kv}_{i}": np.zeros((1, c.num_kv_heads, c.max_position_embeddings, c.head_dim), np.float32)
             for kv in ("key", "value") for i in range(c.num_layers)}
    ids = np.random.default_rng(1).integers(0, c.vocab_size, n)
    rows = np.array([0, n // 2, n - 1])
    logits = sess.run(["logits"], {"input_ids": ids[None], "logit_index": rows[None], "starts": np.array([0]),
                                   "key_count": np.array([n]), **cache})[0][0]  # [3, V]
    ref, _ = TorchBackend(target, None, c.max_position_embeddings).target(ids[None], np.zeros(1, np.int64))
    close(logits, ref[0, rows], "prompt near the context limit")


def test_int8_drafter_graph(tiny_bundle, manifest, engine):
    """The int8 drafter (the CPU default) proposes from nearly the fp32 distribution, and the
    output stays the target's: greedy identical to the target alone, sampled identical in
    distribution (here: same tokens as the fp32 drafter wherever both accept, not required)."""
    e8 = Engine.load(tiny_bundle.path, max_seq=MAX_SEQ)
    assert "drafter_ort" in manifest.graphs and e8.backend._drafter.path.name == "drafter_ort.onnx"
    ids = np.asarray(engine.encode(PROMPT), np.int64)
    _, feats = engine.backend.target(ids[None], np.zeros(1, np.int64))  # [1, n, F]
    u = np.random.default_rng(0).random((1, manifest.drafter.block_size))
    args = (np.array([len(ids)]), np.zeros(1, np.int64), np.array([5]), np.ones(1), u)
    d32 = engine.backend.draft(step_batch(feats, *args))
    d8 = e8.backend.draft(step_batch(feats, *args))
    assert float(np.abs(d8.probs - d32.probs).sum(-1).max()) < 0.1  # total variation < 0.05 per slot
    for prompt in PROMPTS:
        alone = engine.generate(prompt, max_new_tokens=40, scheduler="none")
        assert e8.generate(prompt, max_new_tokens=40, scheduler="fixed").token_ids == alone.token_ids


def test_greedy_drafter_graph(tiny_bundle, manifest, engine, monkeypatch):
    """Calls at T = 0 run the int8 graph without the `If` (drafter_ort_greedy): the tokens and
    confidences of the full int8 graph's greedy branch, and no distributions; over several
    greedy rows, one call. A call with a sampled row drafts row by row (int8): the sampled row
    through the full graph, with its distributions, the greedy one through the greedy graph."""
    be = Engine.load(tiny_bundle.path, max_seq=MAX_SEQ, slots=2, drafter_graph="int8").backend
    assert be._drafter_greedy.path.name == manifest.graphs["drafter_ort_greedy"] == "drafter_ort_greedy.onnx"
    ids = np.asarray(engine.encode(PROMPT), np.int64)
    _, feats = engine.backend.target(ids[None], np.zeros(1, np.int64))  # [1, n, F]
    gamma = manifest.drafter.block_size
    u = np.random.default_rng(0).random((2, gamma))
    one = (np.array([len(ids)]), np.zeros(1, np.int64), np.array([5]))
    greedy = be.draft(step_batch(feats, *one, np.zeros(1, np.float32), u[:1]))
    assert greedy.probs is None
    monkeypatch.setattr(be, "_drafter_greedy", None)  # the full graph, its `If` taking the greedy branch
    full = be.draft(step_batch(feats, *one, np.zeros(1, np.float32), u[:1]))
    monkeypatch.undo()
    assert greedy.tokens.tolist() == full.tokens.tolist()
    close(greedy.confidence_logits, full.confidence_logits, "confidence logits", tol=1e-5)

    two = (np.repeat(feats, 2, 0), np.full(2, len(ids)), np.zeros(2, np.int64), np.array([5, 5]))
    calls = []
    be.on_run = lambda event: calls.append((event.graph, len(event.inputs["anchor"])))  # the backend's timing hook
    both = be.draft(step_batch(*two, np.zeros(2, np.float32), u))
    be.on_run = None
    assert calls == [("drafter_ort_greedy.onnx", 2)] and both.probs is None  # one call over both rows
    assert both.tokens.tolist() == [greedy.tokens[0].tolist()] * 2  # the same rows: the same scale
    mixed = be.draft(step_batch(*two, np.array([0.0, 1.0], np.float32), u))
    sampled = be.draft(step_batch(feats, *one, np.ones(1, np.float32), u[1:]))
    assert mixed.tokens[0].tolist() == greedy.tokens[0].tolist()
    assert mixed.tokens[1].tolist() == sampled.tokens[0].tolist()
    close(mixed.probs[1], sampled.probs[0], "sampled row's draft probs", tol=0)
    assert np.allclose(mixed.probs[1].sum(-1), 1.0, atol=1e-5)


# --- loop level -----------------------------------------------------------------------------------

SCHEDULERS = {"fixed": FixedLength(), "threshold": StaticThreshold(0.5), "none": None}


def reference_generate(tiny_bundle, manifest, ids, temperature, seed, scheduler, max_new_tokens=40):
    backend = TorchBackend(tiny_bundle.target, tiny_bundle.drafter if scheduler is not None else None, MAX_SEQ)
    params = SamplingParams(temperature, max_new_tokens, seed, stop_token_ids=manifest.stop_token_ids)
    return generate(backend, ids, params, scheduler)


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_greedy_generate_matches_torch(tiny_bundle, manifest, engine, scheduler):
    taus = []
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ref = reference_generate(tiny_bundle, manifest, ids, 0.0, 0, SCHEDULERS[scheduler])
        got = engine.generate(prompt, max_new_tokens=40, scheduler=scheduler)
        m = greedy_match(ref.token_ids, got.token_ids, reference_logits(tiny_bundle.target, ids, ref.token_ids))
        assert m.ok, f"{prompt!r} ({scheduler}): {m}"
        assert got.finish_reason == ref.finish_reason
        assert got.prompt_tokens == len(ids)
        taus.append(got.stats.tau)
        if scheduler != "none":
            assert got.stats.emitted == ref.stats.emitted and got.stats.verified == ref.stats.verified
    if scheduler == "fixed":
        assert max(taus) > 1.5, "the copy drafter should be accepted in the tiny model's repetition loops"


def test_sampled_generate_matches_torch(tiny_bundle, manifest, engine):
    """Same seed, same uniforms: token-identical. A split would need an inverse-CDF draw within
    ~1e-7 of a cumulative-probability boundary; none happens for these seeds (checked)."""
    accepted = 0
    for seed in range(5):
        ids = engine.encode(PROMPT)
        ref = reference_generate(tiny_bundle, manifest, ids, 1.0, seed, FixedLength())
        got = engine.generate(PROMPT, max_new_tokens=40, temperature=1.0, seed=seed)
        assert got.token_ids == ref.token_ids, f"seed {seed}"
        assert got.stats.emitted == ref.stats.emitted
        accepted += sum(ref.stats.emitted) - len(ref.stats.emitted)
    assert accepted > 0, "some sampled drafts should be accepted, or the acceptance path is untested"


def test_messages_and_raw_prompts(tiny_bundle, engine):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = tiny_bundle.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)
    assert engine.encode(msgs) == list(expected["input_ids"])
    assert engine.encode(PROMPT, chat=False) == tiny_bundle.tokenizer.encode(PROMPT, add_special_tokens=False)
    r = engine.generate(msgs, max_new_tokens=8)
    assert r.prompt_tokens == len(expected["input_ids"]) and 1 <= len(r.token_ids) <= 8


# --- the lean runtime ------------------------------------------------------------------------------

LEAN = import_blocker("torch", "transformers", "dspark.export") + """
import dspark.runtime
from dspark.runtime import Engine, SamplingParams
from dspark.runtime.tools.cli import main

engine = Engine.load(sys.argv[1], max_seq=128)
result = engine.generate("Hello there, how are you?", max_new_tokens=24)
assert result.token_ids and result.finish_reason in ("length", "stop"), result
core = engine.core("fixed")  # the step-wise core, driven by hand
core.add_request("a", engine.encode("Hi"), SamplingParams(temperature=1.0, seed=3, max_new_tokens=8))
steps = 0
while core.has_unfinished():
    steps += len(core.step())
assert steps >= 1
assert main(["generate", "--bundle", sys.argv[1], "--prompt", "Hi", "--max-new-tokens", "8", "--json",
             "--max-seq", "64"]) == 0
loaded = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
print(json.dumps({"token_ids": result.token_ids, "loaded": loaded, "attempts": attempts}))
"""


def test_runtime_runs_without_torch(tiny_bundle, engine):
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(LEAN), str(tiny_bundle.path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [], f"modules loaded despite the blocker: {out['loaded']}"
    assert out["attempts"] == [], f"the runtime tried to import {out['attempts']}"
    assert out["token_ids"] == engine.generate(PROMPT, max_new_tokens=24).token_ids


# --- streaming and stop strings --------------------------------------------------------------------

def test_streamed_text_equals_result_text(engine):
    for prompt in PROMPTS:
        pieces = []
        r = engine.generate(prompt, max_new_tokens=40, on_text=pieces.append)
        assert "".join(pieces) == r.text == engine.tokenizer.decode(r.token_ids)
        assert len(pieces) > 1


def test_stop_string_ends_generation_early(engine):
    full = engine.generate(PROMPT, max_new_tokens=40, scheduler="none")
    text = full.text
    assert len(text) > 12, text
    stop = text[len(text) // 3: len(text) // 3 + 2]
    cut = text[:text.index(stop)]
    for scheduler in ("none", "fixed"):
        pieces = []
        r = engine.generate(PROMPT, max_new_tokens=40, scheduler=scheduler, stop=[stop], on_text=pieces.append)
        assert r.finish_reason == "stop_string", scheduler
        assert r.text == cut and stop not in r.text
        assert len(r.token_ids) < len(full.token_ids)
        assert r.token_ids == full.token_ids[:len(r.token_ids)]
        assert "".join(pieces).startswith(cut) and stop in "".join(pieces)
    # a stop string that never occurs changes nothing
    r = engine.generate(PROMPT, max_new_tokens=40, stop=["\u00e9\u00e9\u00e9"])
    assert r.token_ids == full.token_ids and r.finish_reason == full.finish_reason


# --- KV buffers ------------------------------------------------------------------------------------

def kv_pointers(backend) -> list[int]:
    return [a.ctypes.data for a in backend.target_kv.arrays + backend.draft_kv.arrays]


def test_kv_buffers_are_reused(engine, monkeypatch):
    be = engine.backend
    before = kv_pointers(be)
    seen = []
    for kv in (be.target_kv, be.draft_kv):
        write = kv.write

        def recording(new_rows, starts, first_slot=0, _write=write):
            seen.append(kv_pointers(be))
            _write(new_rows, starts, first_slot)

        monkeypatch.setattr(kv, "write", recording)

    short, long_ = PROMPT, "Tell me a long story about a dragon who lived in a cave by the sea, please."
    first = engine.generate(short, max_new_tokens=40)
    engine.generate(long_, max_new_tokens=60, temperature=1.0, seed=3)  # fills rows past the short run's
    again = engine.generate(short, max_new_tokens=40)
    assert again.token_ids == first.token_ids  # positions restart; stale rows beyond them are never read
    assert len(seen) > 20 and all(p == before for p in seen), "KV buffers were reallocated"
    assert kv_pointers(be) == before
    assert be.target_kv.max_seq == MAX_SEQ and all(a.flags.c_contiguous for a in be.target_kv.arrays)


# --- the bundle on disk ----------------------------------------------------------------------------

def test_bundle_files_are_complete_and_readable(tiny_bundle, manifest):
    """Every file is in the manifest with its size and readable by other users (a service account
    serving a bundle someone else exported); no temporary directory is left next to the bundle."""
    files = {p.name: p for p in tiny_bundle.path.iterdir()}
    assert set(files) == set(manifest.files) | {"manifest.json"}
    for name, p in files.items():
        assert p.stat().st_mode & 0o444 == 0o444, f"{name} has mode {oct(p.stat().st_mode & 0o777)}"
    assert [p.name for p in tiny_bundle.path.parent.iterdir() if p.name.startswith(".")] == []


def test_reuse_target_copies_the_target_graphs(tiny_bundle, tmp_path):
    """A second drafter for the same target: the target graphs are the first bundle's (the same
    nodes and weights, now in the new bundle's weights.bin), the new drafter graph is its own,
    and the bundle serves losslessly. A drafter that needs other feature layers, or another
    target, is refused before anything is written."""
    import onnx
    from factories import tiny_drafter

    from dspark.export import save_drafter
    from dspark.export.bundle import export_bundle
    from dspark.runtime.errors import CheckpointError

    t, layers = tiny_bundle.target, tiny_bundle.drafter.cfg.target_layer_ids
    save_drafter(tiny_drafter(t, seed=7, block_size=3, layer_ids=layers), tmp_path / "d2")
    out = tmp_path / "b2"
    m = export_bundle(out, tiny_bundle.target_dir, tmp_path / "d2", progress=False, quick_profile=False, reuse_target=tiny_bundle.path)
    for f in ("target.onnx", "target_ort.onnx"):
        new, old = (onnx.load(str(b / f)).graph for b in (out, tiny_bundle.path))
        assert new.node == old.node
        assert [(t.name, onnx.numpy_helper.to_array(t).tobytes()) for t in new.initializer] == \
               [(t.name, onnx.numpy_helper.to_array(t).tobytes()) for t in old.initializer]
    assert m.drafter.block_size == 3 and m.graphs == Manifest.load(tiny_bundle.path).graphs
    e = Engine.load(out, max_seq=128, threads=1)
    prompt = "hello"
    spec = e.generate(prompt, max_new_tokens=12, scheduler="fixed")
    alone = e.generate(prompt, max_new_tokens=12, scheduler="none")
    assert spec.token_ids == alone.token_ids

    other = [i for i in range(t.cfg.num_layers - 1) if i not in layers][:1] + list(layers[1:])
    save_drafter(tiny_drafter(t, seed=7, layer_ids=other), tmp_path / "d3")
    with pytest.raises(CheckpointError, match="features of layers"):
        export_bundle(tmp_path / "b3", tiny_bundle.target_dir, tmp_path / "d3", progress=False, quick_profile=False,
                      reuse_target=tiny_bundle.path)
    assert not (tmp_path / "b3").exists()


def _optimized_ops(path, tmp_path) -> list[str]:
    """The op types of a graph after ONNX Runtime's graph optimizations, subgraphs included."""
    import onnx
    import onnxruntime as ort

    from dspark.export.tensorrt_ops import walk_nodes
    from dspark.runtime.backends.onnxruntime import session_options

    so = session_options(None)  # the process's shared pool, as every other session of the tests
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in walk_nodes(onnx.load(so.optimized_model_filepath, load_external_data=False).graph)]


def test_every_rms_norm_is_fused(tiny_bundle, manifest, tmp_path):
    """ONNX Runtime fuses each RMSNorm of the exported graphs into one SimplifiedLayerNormalization:
    the drafter's modules compute Hugging Face's x * rsqrt(...), which it would leave as five ops
    (Pow, ReduceMean, Add, Sqrt, Reciprocal) and a Mul; and one whose Mul a transpose separates.
    The drafter is exported with random norm weights: the exporter folds away a Mul by a weight
    of ones, which leaves nothing to fuse."""
    import copy

    import torch

    from dspark.export.layers import RMSNorm
    from dspark.export.onnx_export import export_drafter
    from dspark.export.ort_graph import export_drafter_ort

    ops = _optimized_ops(tiny_bundle.path / manifest.graphs["target"], tmp_path)
    assert "SimplifiedLayerNormalization" in ops and "Sqrt" not in ops
    drafter = copy.deepcopy(tiny_bundle.drafter)
    norms = [m for m in drafter.modules() if isinstance(m, RMSNorm)]
    with torch.no_grad():
        for m in norms:
            m.weight.uniform_(0.5, 1.5)
    export_drafter(drafter, tmp_path / "drafter.onnx")
    export_drafter_ort(tmp_path / "drafter.onnx", tmp_path / "drafter_ort.onnx")
    for graph in ("drafter.onnx", "drafter_ort.onnx"):
        ops = _optimized_ops(tmp_path / graph, tmp_path)
        assert "Sqrt" not in ops and "Pow" not in ops, (graph, sorted(set(ops)))
        # q/k norms run on the queries and on both kinds of keys: at least one fused op per module
        assert ops.count("SimplifiedLayerNormalization") >= len(norms), graph
