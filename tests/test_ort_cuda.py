"""ONNX Runtime's CUDA-provider backend (runtime/backends/ort_cuda.py), on a CPU: the same
IOBinding code by address over the CPU provider, with host arrays standing in for the device
buffers (fake_tensorrt.HostDevice: numpy arrays with their addresses). Checks our bindings, the
shared GPU layer around them and the refusals; nothing here ran on CUDA."""
import numpy as np
import onnxruntime as ort
import pytest

from fake_tensorrt import HostDevice
from dspark.runtime import BackendError, BundleError, Engine, FixedLength, InputError, Request, SamplingParams
from dspark.runtime import generate, generate_batch
from dspark.runtime.backends.onnxruntime import OrtBackend
from dspark.runtime.backends.ort_cuda import ort_cuda_backend
from dspark.runtime.manifest import Manifest

MAX_SEQ = 256


def on_host(bundle, manifest, **kw):
    return ort_cuda_backend(bundle, manifest, MAX_SEQ, device=HostDevice(), provider="cpu", **kw)


def test_generations_equal_the_cpu_backend(tiny_bundle):
    """Greedy and sampled generations (a prompt longer than the context bucket, so the past
    width moves between buckets) equal the CPU backend's on the same portable graphs; the KV
    caches are the shared layer's buffers, written in place through their bound addresses."""
    m = Manifest.load(tiny_bundle.path)
    prompt = list(range(5, 95)) * 2  # 180 tokens: past widths 128 and 256
    for T in (0.0, 1.0):
        params = SamplingParams(T, 40, seed=3)
        ref = generate(OrtBackend(tiny_bundle.path, m, MAX_SEQ, target_graph="portable", drafter_graph="fp32"),
                       prompt, params, FixedLength())
        be = on_host(tiny_bundle.path, m)
        caches = [(c.__array_interface__["data"][0], c) for c in be._target.kv]
        got = generate(be, prompt, params, FixedLength())
        assert got.token_ids == ref.token_ids and got.stats.emitted == ref.stats.emitted
        assert be.accepts_on_device and be.stats["target"].eager > 0 and be.stats["target"].captures == 0
        assert all(c.__array_interface__["data"][0] == addr for addr, c in caches)  # never reallocated
        assert all(np.any(c[0, :, len(prompt) - 1]) for _, c in caches)  # the prompt's rows, written there
    greedy = SamplingParams(0.0, 40)
    target_alone = generate(on_host(tiny_bundle.path, m, speculative=False), prompt, greedy, None)
    assert target_alone.token_ids == generate(on_host(tiny_bundle.path, m), prompt, greedy, FixedLength()).token_ids


def test_concurrent_requests_equal_solo_runs(tiny_bundle):
    """R = 4 slots: requests join and leave between steps, calls run at batch buckets 1..4, and
    every greedy and sampled output equals the same request served alone."""
    m = Manifest.load(tiny_bundle.path)
    prompts = [list(range(5, 40)), [7, 8, 9], list(range(50, 90)) * 2, [11, 3, 42, 42, 9], [60, 61]]
    for T in (0.0, 1.0):
        params = [SamplingParams(T, n, seed=i) for i, n in enumerate([30, 12, 30, 24, 30])]
        be = on_host(tiny_bundle.path, m, slots=4)
        got = generate_batch(be, [Request(p, q) for p, q in zip(prompts, params)], FixedLength())
        for prompt, q, g in zip(prompts, params, got):
            alone = generate(on_host(tiny_bundle.path, m), prompt, q, FixedLength())
            assert g.token_ids == alone.token_ids, (T, prompt)
        assert max(g.stats.batch[0] for g in got) == 4 and min(min(g.stats.batch) for g in got) < 4


def test_refusals(tiny_bundle, tmp_path):
    m = Manifest.load(tiny_bundle.path)
    with pytest.raises(InputError, match="portable target graph"):
        on_host(tiny_bundle.path, m, target_graph="ort")
    with pytest.raises(InputError, match="int8 drafter graphs are for the CPU provider"):
        on_host(tiny_bundle.path, m, drafter_graph="int8")
    with pytest.raises(InputError, match="slots is 0"):
        on_host(tiny_bundle.path, m, slots=0)
    no_portable = Manifest.load(tiny_bundle.path)
    no_portable.graphs.pop("target")
    with pytest.raises(BundleError, match="dspark export --portable"):
        on_host(tiny_bundle.path, no_portable)


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this onnxruntime has CUDA")
def test_cuda_provider_without_onnxruntime_gpu(tiny_bundle):
    """`--provider cuda` on the CPU build of onnxruntime names the package to install."""
    with pytest.raises(BackendError, match="pip install onnxruntime-gpu"):
        Engine.load(tiny_bundle.path, provider="cuda")
