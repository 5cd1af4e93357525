"""The TensorRT builder, the engine metadata and the TensorRT backend's refusals, on a CPU.

The builder runs against tests/fake_tensorrt.py: a labelled FAKE of the tensorrt module that
records our calls and checks our optimization profiles against the graphs' ONNX inputs.
These are unit tests of our code; no TensorRT was built or run."""
import json
import shutil
import sys

import pytest

import fake_tensorrt
from factories import import_blocker
from dspark.runtime import BackendError, BundleError, Engine, InputError
from dspark.runtime.backends.gpu.cupy_device import GpuInfo
from dspark.runtime.graph_io import DRAFTER_INPUTS, PAST, TARGET_INPUTS, kv_names
from dspark.runtime.tools.cli import main
from dspark.runtime.manifest import Manifest
from dspark.runtime.backends.tensorrt import build as trt_build
from dspark.runtime.backends.tensorrt.meta import check_compatible, engine_meta
from dspark.runtime.backends.tensorrt.profiles import EngineShapes, check_precision, drafter_profiles, profile_index, target_profiles

H200 = GpuInfo("NVIDIA H200 (fake)", (9, 0))


@pytest.fixture
def bundle(tiny_bundle, tmp_path):
    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle.path, out)
    return out


@pytest.fixture
def fake_trt(monkeypatch):
    fake_tensorrt.calls.clear()
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)
    monkeypatch.setattr(trt_build, "gpu_info", lambda: H200)
    return fake_tensorrt


def test_profiles_follow_the_manifest(tiny_bundle):
    m = Manifest.load(tiny_bundle.path)
    s = EngineShapes.for_manifest(m, max_seq=256, max_batch=4, prefill_chunk=64)
    assert s == EngineShapes(max_seq=256, max_query=m.drafter.block_size + 1, max_batch=4, prefill_chunk=64)
    t, d = target_profiles(m, s), drafter_profiles(m, s)
    g, hkv, hd = m.drafter.block_size, m.target.num_kv_heads, m.target.head_dim
    input_ids, _, _, past_mask = TARGET_INPUTS
    features, positions = DRAFTER_INPUTS[:2]
    past = kv_names(PAST, m.target.num_layers)
    assert t["verify"][input_ids] == ((1, 1), (1, g + 1), (4, g + 1))
    assert t["prefill"][input_ids] == ((1, 1), (1, 64), (1, 64))
    assert t["verify"][past_mask] == ((1, 1), (1, 256), (4, 256))
    assert t["verify"][past[0]] == ((1, hkv, 256, hd), (1, hkv, 256, hd), (4, hkv, 256, hd))
    assert sorted(k for k in t["verify"] if k.startswith((f"{PAST}_key_", f"{PAST}_value_"))) == sorted(past)
    assert d["verify"][positions] == ((1, 1 + g), (1, g + 1 + g), (4, g + 1 + g))
    assert d["prefill"][features][2] == (1, 64, m.drafter.feature_dim)
    assert [profile_index(s, 1, r) for r in (1, g + 1, g + 2, 64)] == [1, 1, 0, 0]
    with pytest.raises(InputError):
        profile_index(s, 2, 64)  # prefill is batch 1
    with pytest.raises(InputError):
        EngineShapes.for_manifest(m, max_seq=m.target.max_position_embeddings + 1)


def test_precision_rules():
    assert check_precision("fp32", "float32", (7, 5)).tf32 is False
    assert check_precision("tf32", "float32", (8, 0)).tf32 is True
    with pytest.raises(BackendError, match="compute capability 8.0"):
        check_precision("tf32", "float32", (7, 5))
    with pytest.raises(BackendError, match="exported in bfloat16"):
        check_precision("bf16", "float32", (9, 0))  # strongly typed: the graph's dtype is the precision
    with pytest.raises(InputError):
        check_precision("int4", "float32", None)


def test_build_against_the_fake(bundle, fake_trt, tmp_path):
    cache = tmp_path / "timing.cache"
    meta = trt_build.build_tensorrt(bundle, max_seq=128, prefill_chunk=32, timing_cache=cache, log=lambda s: None)
    assert meta["tensorrt_version"] == fake_trt.__version__ and meta["compute_capability"] == [9, 0]
    assert meta["precision"] == "fp32" and meta["shapes"]["max_seq"] == 128
    m = Manifest.load(bundle)  # the manifest was rewritten, and its file list checks out
    assert m.extra["tensorrt"] == meta and set(meta["engines"].values()) <= set(m.files)
    builds = [c for c in fake_trt.calls if c[0] == "build"]
    assert len(builds) == 2
    for (_, network, config), role in zip(builds, ("target", "drafter")):
        plan = json.loads((bundle / meta["engines"][role]).read_bytes())
        assert plan["fake_plan"] and not plan["tf32"] and len(plan["profiles"]) == 2
        assert network.flags == 0  # TensorRT 11: strongly typed, and the STRONGLY_TYPED flag deprecated
    parsed = [c[1] for c in fake_trt.calls if c[0] == "parse_from_file"]
    assert parsed == [str(bundle / "target.onnx"), str(bundle / "drafter.onnx")]  # never target_ort.onnx
    # the timing cache: carried from the target build to the drafter build, saved, and reused next time
    assert [c[1] for c in fake_trt.calls if c[0] == "create_timing_cache"] == [b"", b'{"builds": 1}']
    assert json.loads(cache.read_bytes()) == {"builds": 2}
    fake_trt.calls.clear()
    trt_build.build_tensorrt(bundle, precision="tf32", max_seq=128, prefill_chunk=32, timing_cache=cache,
                             log=lambda s: None)
    assert [c[1] for c in fake_trt.calls if c[0] == "create_timing_cache"][0] == b'{"builds": 2}'
    assert json.loads((bundle / "target.tf32.plan").read_bytes())["tf32"]


def test_build_refuses_bad_inputs(bundle, fake_trt, tmp_path, monkeypatch):
    with pytest.raises(BackendError, match="exported in float16"):
        trt_build.build_tensorrt(bundle, precision="fp16", log=lambda s: None)
    monkeypatch.setattr(trt_build, "gpu_info", lambda: GpuInfo("old GPU", (7, 0)))
    with pytest.raises(BackendError, match="compute capability 8.0"):
        trt_build.build_tensorrt(bundle, precision="tf32", log=lambda s: None)
    m = json.loads((bundle / "manifest.json").read_text())
    m["graphs"].pop("drafter")
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="no ONNX graph for drafter"):
        trt_build.build_tensorrt(bundle, log=lambda s: None)


def test_build_without_tensorrt_is_a_clear_error(bundle, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    assert main(["build", "--bundle", str(bundle), "--backend", "tensorrt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tensorrt package is not installed" in err and "Traceback" not in err


def test_tensorrt_10_or_a_failed_start_is_a_clear_error(bundle, fake_trt, capsys, monkeypatch):
    """TensorRT 10 (weakly typed networks by default, `device_memory_size`), or a Builder that
    TensorRT cannot create (the bindings raise pybind11's TypeError for a null object): exit 2
    with the install command, never a traceback."""
    monkeypatch.setattr(fake_trt, "__version__", "10.16.1.11")
    assert main(["build", "--bundle", str(bundle), "--backend", "tensorrt"]) == 2
    err = capsys.readouterr().err
    assert "TensorRT 10.16.1.11 is installed" in err and "dspark-trt[tensorrt]" in err and "Traceback" not in err
    monkeypatch.setattr(fake_trt, "__version__", "11.4.0-fake")

    def no_cuda(logger):
        raise TypeError("pybind11::init(): factory function returned nullptr")

    monkeypatch.setattr(fake_trt, "Builder", no_cuda)
    assert main(["build", "--bundle", str(bundle), "--backend", "tensorrt"]) == 2
    err = capsys.readouterr().err
    assert "could not create its builder (pybind11::init()" in err and "nvidia-smi" in err and "Traceback" not in err


def test_engine_mismatch_names_the_rebuild_command(bundle, fake_trt):
    meta = trt_build.build_tensorrt(bundle, max_seq=128, prefill_chunk=32, timing_cache=bundle / "t.cache",
                                    log=lambda s: None)
    m = Manifest.load(bundle)
    assert engine_meta(m, bundle) == meta
    assert check_compatible(meta, bundle, fake_trt.__version__, (9, 0), "H200").max_seq == 128
    with pytest.raises(BackendError, match=r"built with TensorRT 11\.4\.0-fake, this is TensorRT 11\.3\.0.*"
                                           r"dspark build --bundle .* --backend tensorrt --precision fp32 --max-seq 128"):
        check_compatible(meta, bundle, "11.3.0", (9, 0), "H200")
    with pytest.raises(BackendError, match=r"compute capability 9\.0 .*this GPU is 8\.6"):
        check_compatible(meta, bundle, fake_trt.__version__, (8, 6), "A10")
    m.extra.pop("tensorrt")
    with pytest.raises(BundleError, match="has no TensorRT engines"):
        engine_meta(m, bundle)


def test_tensorrt_backend_refuses_to_open_here(bundle, fake_trt, capsys, monkeypatch):
    """No TensorRT engines, then no tensorrt, then (with the fake) no CuPy: a typed error each time."""
    with pytest.raises(BundleError, match="has no TensorRT engines"):
        Engine.load(bundle, backend="tensorrt")
    trt_build.build_tensorrt(bundle, max_seq=128, prefill_chunk=32, timing_cache=bundle / "t.cache",
                             log=lambda s: None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(BackendError, match="CuPy is not installed"):
        Engine.load(bundle, backend="tensorrt")
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    rc = main(["generate", "--bundle", str(bundle), "--backend", "tensorrt", "--prompt", "Hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "tensorrt package is not installed" in err and "Traceback" not in err


LEAN = import_blocker("torch", "tensorrt", "cupy", "polygraphy") + """
import dspark.runtime.backends.tensorrt.backend, dspark.runtime.backends.tensorrt.build, dspark.runtime.backends.gpu.graph_backend
import dspark.runtime.backends.gpu.cupy_device, dspark.runtime.backends.ort_cuda, dspark.runtime.tools.validate, dspark.runtime.tools.cli
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED) + attempts))
"""


def test_gpu_modules_import_without_gpu_packages():
    import subprocess
    import textwrap

    p = subprocess.run([sys.executable, "-c", textwrap.dedent(LEAN)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []


def test_tensorrt_backend_glue_on_the_fake(bundle, fake_trt):
    """Our TensorRT backend code end to end on the fake: engines "executed" by ONNX Runtime over
    host arrays found by address. Checks our side only (profile choice per call, a context per
    bucket, input shapes inside the profiles, KV and output binding, chunked prefill, device
    acceptance): greedy and sampled generations equal ONNX Runtime's on the same graphs."""
    from dspark.runtime import FixedLength, SamplingParams, generate
    from dspark.runtime.backends.onnxruntime import OrtBackend
    from dspark.runtime.backends.tensorrt.backend import tensorrt_backend

    trt_build.build_tensorrt(bundle, max_seq=320, prefill_chunk=64, timing_cache=bundle / "t.cache",
                             log=lambda s: None)
    m = Manifest.load(bundle)
    prompt = list(range(5, 95)) * 2  # 180 tokens: prefill chunks of the prefill profile, contexts 128 to 320
    for T in (0.0, 1.0):
        params = SamplingParams(T, 40, seed=3)
        ref = generate(OrtBackend(bundle, m, 320, target_graph="portable", drafter_graph="fp32"), prompt, params,
                       FixedLength())
        be = tensorrt_backend(bundle, m, device=fake_trt.HostDevice())
        got = generate(be, prompt, params, FixedLength())
        assert got.token_ids == ref.token_ids and got.stats.emitted == ref.stats.emitted
        assert be.accepts_on_device and be.stats["target"].replays > 0 and not be.stats["target"].capture_failures
        step = be._target.step
        assert {c.profile for c in step.engine.contexts} == {0, 1}  # prefill chunks and verification
        assert len(step.engine.contexts) == be.stats["target"].captures + len(step.eager)  # a context per bucket
        assert all(c.strategy == fake_trt.ExecutionContextAllocationStrategy.USER_MANAGED for c in step.engine.contexts)
    with pytest.raises(InputError, match="built for max_seq 320"):
        tensorrt_backend(bundle, m, max_seq=256, device=fake_trt.HostDevice())
    with pytest.raises(InputError, match="slots=2: .* serve 1 to 1 .*--max-batch 2"):
        tensorrt_backend(bundle, m, device=fake_trt.HostDevice(), slots=2)


def test_tensorrt_backend_serves_concurrent_requests_on_the_fake(bundle, fake_trt):
    """Engines built with --max-batch 4 serve R = 4 requests at once through the shared GPU layer:
    verification at batch buckets 1..4 under the verify profile, prefill at batch 1, and every
    greedy and sampled output equal to the same request served alone (on the fake, which runs the
    graphs with ONNX Runtime: our side of the calls, not TensorRT)."""
    from dspark.runtime import FixedLength, Request, SamplingParams, generate, generate_batch
    from dspark.runtime.backends.tensorrt.backend import tensorrt_backend

    trt_build.build_tensorrt(bundle, max_seq=256, max_batch=4, prefill_chunk=32, timing_cache=bundle / "t.cache",
                             log=lambda s: None)
    m = Manifest.load(bundle)
    prompts = [list(range(5, 40)), [7, 8, 9], list(range(50, 90)) * 2, [11, 3, 42, 42, 9], [60, 61]]
    for T in (0.0, 1.0):
        params = [SamplingParams(T, n, seed=i) for i, n in enumerate([30, 12, 30, 24, 30])]
        be = tensorrt_backend(bundle, m, device=fake_trt.HostDevice(), slots=4)
        got = generate_batch(be, [Request(p, q) for p, q in zip(prompts, params)], FixedLength())
        for prompt, q, g in zip(prompts, params, got):
            alone = generate(tensorrt_backend(bundle, m, device=fake_trt.HostDevice()), prompt, q, FixedLength())
            assert g.token_ids == alone.token_ids, (T, prompt)
        assert max(g.stats.batch[0] for g in got) == 4 and min(min(g.stats.batch) for g in got) < 4
        assert {c.profile for c in be._target.step.engine.contexts} == {0, 1}
    with pytest.raises(InputError, match="slots=5: .* serve 1 to 4"):
        tensorrt_backend(bundle, m, device=fake_trt.HostDevice(), slots=5)


def test_a_quantized_bundle_builds_from_its_qdq_portable_graph(int4_portable_bundle, fake_trt, tmp_path):
    """An int4 bundle exported with --portable builds (its target.onnx reads the blocks through
    DequantizeLinear), the metadata names the weights' precision, and on the fake, which runs
    that graph with ONNX Runtime, greedy DSpark equals the target alone on the same engines.
    Our side of the calls only: no TensorRT built this graph."""
    from dspark.runtime import FixedLength, SamplingParams, generate
    from dspark.runtime.backends.tensorrt.backend import tensorrt_backend

    out = tmp_path / "int4"
    shutil.copytree(int4_portable_bundle[0], out)  # the build writes its engines into the bundle
    meta = trt_build.build_tensorrt(out, max_seq=256, prefill_chunk=64, timing_cache=out / "t.cache",
                                    log=lambda s: None)
    assert meta["weights"] == "int4" and meta["precision"] == "fp32"
    m = Manifest.load(out)
    prompt = list(range(5, 95))
    greedy = SamplingParams(0.0, 40)
    alone = generate(tensorrt_backend(out, m, device=fake_trt.HostDevice(), speculative=False), prompt, greedy, None)
    dspark = generate(tensorrt_backend(out, m, device=fake_trt.HostDevice()), prompt, greedy, FixedLength())
    assert dspark.token_ids == alone.token_ids and len(dspark.stats.emitted) < len(alone.token_ids)  # some drafts accepted
