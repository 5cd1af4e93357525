"""The default export of the embedded SmolLM2 GGUF (`--precision auto` = gguf): the GGUF's own
Q4_1 / Q8_0 blocks in an int8-activation ONNX Runtime graph, which is the target. Slow: one
export of the real model per session (~1.5 min)."""
from __future__ import annotations

import numpy as np
import pytest
from factories import assert_rows_invariant, assert_symmetric_matmulnbits

from dspark.runtime import Engine
from dspark.runtime.manifest import Manifest

pytestmark = pytest.mark.slow

PROMPTS = ["What is 17 * 23? Think step by step.", "Write a short poem about the sea."]


@pytest.fixture(scope="module")
def gguf_bundle(tmp_path_factory, smollm2_path):
    from dspark.runtime.tools.cli import main

    out = tmp_path_factory.mktemp("gguf") / "smollm2"
    assert main(["export", "--out", str(out), "--draft-vocab", "8192"]) == 0
    return out


def test_the_default_precision_of_a_gguf_is_its_own_blocks(gguf_bundle):
    m = Manifest.load(gguf_bundle)
    assert m.precision == "gguf"
    assert assert_symmetric_matmulnbits(gguf_bundle / "target_ort.onnx") == 121  # 4 per layer + the LM head
    assert m.extra["precision"]["name"] == "gguf"
    assert "ai.onnx::DequantizeLinear" in m.extra["ops"]["target_ort"]


def test_rows_are_invariant_on_the_real_model(gguf_bundle):
    assert_rows_invariant(Engine.load(gguf_bundle, max_seq=512, slots=2), PROMPTS)


def test_greedy_speculation_equals_the_gguf_target_alone(gguf_bundle):
    engine = Engine.load(gguf_bundle, max_seq=512, slots=2)
    alone = engine.generate_batch(PROMPTS, max_new_tokens=64, scheduler="none")
    for scheduler in ("fixed", "threshold"):
        spec = engine.generate_batch(PROMPTS, max_new_tokens=64, scheduler=scheduler)  # 2 requests, batched
        assert [r.token_ids for r in spec] == [r.token_ids for r in alone], scheduler


def test_top1_agrees_with_the_fp32_bundle(gguf_bundle, default_bundle):
    """Teacher-forced on the fp32 target's own answer: the gguf target's argmax agrees at most
    positions (docs/quantization.md: 97 % over 2,000 positions of held-out text)."""
    fp32 = Engine.load(default_bundle.path, max_seq=512)
    gguf = Engine.load(gguf_bundle, max_seq=512)
    prompt = fp32.encode(PROMPTS[0])
    answer = fp32.generate(PROMPTS[0], max_new_tokens=96, scheduler="none").token_ids
    ids = np.asarray(prompt + answer, np.int64)[None]  # [1, n]
    ref, _ = fp32.backend.target(ids, np.zeros(1, np.int64))
    got, _ = gguf.backend.target(ids, np.zeros(1, np.int64))
    rows = slice(len(prompt) - 1, ids.shape[1] - 1)  # the positions that predict the answer
    assert (ref[0, rows].argmax(-1) == got[0, rows].argmax(-1)).mean() >= 0.9


def test_the_default_bundle_is_small_and_ready_to_schedule(gguf_bundle, smollm2_path):
    """Each weight once: at most 1.5 x (GGUF + drafter checkpoint) on disk. Ready out of the box:
    the shipped calibration (fitted on this drafter, GGUF and precision) and this machine's
    quick profile are in, so `auto` plans with the cost model from the first request, without
    a fallback warning, and stays lossless."""
    import warnings

    from dspark.export.bundle import SHIPPED_DRAFTER

    on_disk = sum(p.stat().st_size for p in gguf_bundle.iterdir() if p.is_file())
    sources = smollm2_path.stat().st_size + sum(p.stat().st_size for p in SHIPPED_DRAFTER.iterdir())
    assert on_disk <= 1.5 * sources, (on_disk, sources)
    assert (gguf_bundle / "calibration.json").read_bytes() == (SHIPPED_DRAFTER / "calibration.json").read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine.load(gguf_bundle, max_seq=512)
        assert engine.scheduler("auto").name == "cost"
        spec = engine.generate(PROMPTS[0], max_new_tokens=64)
    assert spec.token_ids == engine.generate(PROMPTS[0], max_new_tokens=64, scheduler="none").token_ids
