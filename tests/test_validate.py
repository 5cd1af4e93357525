"""`dspark validate` on the CPU: the portable ONNX graph and the PyTorch reference against
ONNX Runtime's default graph, a deliberately broken backend caught, and bad requests refused."""
import json

import numpy as np
import pytest

from dspark.runtime import InputError
from dspark.runtime.backends import Draft, StepBatch, Verdict
from dspark.runtime.backends.base import verify_on_host
from dspark.runtime.manifest import Manifest
from dspark.runtime.tools.cli import main
from dspark.runtime.tools.validate import compare, open_any_backend, validate


@pytest.mark.parametrize("backend", ["ort-portable", "torch"])
def test_validate_cli_passes_on_cpu(tiny_bundle, capsys, backend, one_torch_thread):
    argv = ["validate", "--bundle", str(tiny_bundle.path), "--backend", backend, "--json", "--max-new-tokens", "24"]
    if backend == "torch":
        argv += ["--target", str(tiny_bundle.target_dir), "--drafter", str(tiny_bundle.drafter_dir)]
    rc = main(argv)
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"], report
    names = [c["name"] for c in report["comparisons"]]
    assert {"prefill logits", "verify features", "draft probs (T=1)", "draft tokens (T=0)"} <= set(names)
    assert len(report["greedy"]) == 2 and all(c["method"] in ("numpy", "polygraphy", "exact")
                                              for c in report["comparisons"])


class Perturbed:
    """A backend whose target logits are off by 0.1: validation must fail."""

    def __init__(self, inner):
        self.inner, self.block_size, self.vocab_size = inner, inner.block_size, inner.vocab_size
        self.max_seq, self.slots = inner.max_seq, inner.slots
        self.accepts_on_device, self.drafter_graph, self.on_run = False, inner.drafter_graph, None

    def prefill(self, slot, tokens, ingest):
        logits, feats = self.inner.prefill(slot, tokens, ingest)
        return logits + 0.1, feats

    def target(self, tokens, starts):
        logits, feats = self.inner.target(tokens, starts)
        return logits + 0.1, feats

    def draft(self, batch: StepBatch) -> Draft:
        return self.inner.draft(batch)

    def verify(self, batch: StepBatch, draft: Draft) -> Verdict:
        return verify_on_host(self, batch, draft)


def test_validate_catches_a_wrong_backend(tiny_bundle):
    m = Manifest.load(tiny_bundle.path)
    ref = open_any_backend("onnxruntime", tiny_bundle.path, m, 256)
    bad = Perturbed(open_any_backend("onnxruntime", tiny_bundle.path, m, 256))
    v = validate(ref, bad, [[5, 6, 7, 8, 9]], ("onnxruntime", "perturbed"), max_new_tokens=8)
    failed = {c.name for c in v.comparisons if not c.ok}
    assert not v.ok and {"prefill logits", "verify logits"} <= failed
    assert "FAIL" in v.lines()[-1]


def test_compare_tolerance_and_shapes():
    a = np.array([1.0, 100.0])
    assert compare("x", a, a + [1e-3, 0.05], atol=1e-3, rtol=1e-3).ok  # 0.05 <= 1e-3 + 1e-3 * 100
    assert not compare("x", a, a + [2e-2, 0.0], atol=1e-3, rtol=1e-3).ok
    assert not compare("x", a, a[:1], atol=1, rtol=1).ok


def test_validate_refuses_bad_requests(tiny_bundle, capsys, tmp_path):
    rc = main(["validate", "--bundle", str(tiny_bundle.path), "--backend", "nope"])
    assert rc == 2 and "unknown backend 'nope'" in capsys.readouterr().err
    rc = main(["validate", "--bundle", str(tiny_bundle.path), "--backend", "torch", "--target",
               str(tiny_bundle.target_dir)])  # the untrained default drafter is not the bundle's
    assert rc == 2 and "is not the one bundle" in capsys.readouterr().err
    with pytest.raises(InputError):
        open_any_backend("tensorrt-but-typo", tiny_bundle.path, Manifest.load(tiny_bundle.path), None)
    import torch

    if not torch.cuda.is_available():
        rc = main(["validate", "--bundle", str(tiny_bundle.path), "--backend", "torch-cuda-graph", "--target",
                   str(tiny_bundle.target_dir), "--drafter", str(tiny_bundle.drafter_dir)])
        err = capsys.readouterr().err
        assert rc == 2 and "sees no CUDA device" in err and "Traceback" not in err
