"""scripts/gpu_profile.sh: the profiler a lent GPU runs. Here, without a GPU: its --smoke mode (tiny
model, CPU stand-in device, CPU-only profiler) must run every section but torch.compile end to end,
every variant (tf32, bf16 cast in the script, host acceptance, fewer syncs) greedy-identical to
fp32, so that the GPU run is unlikely to fail on a plain bug. The trace parsing that only a CUDA
trace exercises (kernels of graph replays, GPU idle time, CUDA API calls by code) is checked on a
synthetic trace shaped like the profiler's."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def test_smoke_mode_runs_every_section(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_profile.sh"), "--smoke"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "gpu_profile.json").read_text())
    assert res["ok"] and res["steps"]["ok"] and res["cycle"]["ok"] and res["variants"]["ok"]
    assert {"target B=1 S=1 P=64", "target B=1 S=8 P=64", "drafter B=4 S=3 P=64"} <= set(res["steps"])
    codes = {r["code"] for r in res["cycle"]["host"]["by_code"]}
    assert {"cycle", "draft()", "verify()", "replay target", "replay drafter"} <= codes
    assert any(c.startswith("upload input_ids @ steps.py") for c in codes)
    assert any(c.startswith("compute (acceptance rule") for c in codes)  # the device acceptance rule ran
    v = res["variants"]
    assert v["reference"] == "fp32" and set(v) - {"ok", "seconds", "reference"} == {"fp32", "tf32", "bf16", "host-accept", "fewer-syncs", "bf16+fewer-syncs",
                                          "tf32+fewer-syncs"}
    for name, row in v.items():
        if isinstance(row, dict):
            assert row["greedy_vs_reference"]["dspark"] == ["identical"] * 3, (name, row["greedy_vs_reference"])
            assert row["run"]["tau"] > 1 and "target B=1 S=8 P=64" in row["graph_time_ms"]
    assert "target B=4 S=8 P=64" in v["bf16"]["graph_time_ms"]
    assert res["compile"]["skipped"] == "smoke mode"
    assert {"gpu_profile.json", "gpu_profile.txt", "gpu_profile.log", "cycle_trace.json.gz", "nvidia-smi.txt"} <= {
        f.name for f in out.iterdir()}
    assert "variants (batch 1)" in (out / "gpu_profile.txt").read_text()


def test_without_a_gpu_it_says_so(tmp_path):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_profile.sh")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 2 and "no GPU" in p.stdout + p.stderr
    assert "no GPU" in json.loads((tmp_path / "gpu_profile.json").read_text())["status"]


def _trace() -> list[dict]:
    """Two graph replays of 3 kernels each (correlation 1 and 2, the second replay with an idle gap),
    a CuPy kernel and a copy outside graphs, two cycles, and CUDA API calls in labelled code."""
    k = lambda name, ts, dur, corr: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                     "args": {"correlation": corr}}
    api = lambda name, ts, dur, corr: {"ph": "X", "cat": "cuda_runtime", "name": name,  # noqa: E731
                                       "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}
    ann = lambda name, ts, dur: {"ph": "X", "cat": "user_annotation", "name": name,  # noqa: E731
                                 "ts": ts, "dur": dur, "tid": 7}
    return [
        ann("cycle", 0, 100), ann("cycle", 100, 100),
        ann("verify()", 10, 60), ann("replay target", 12, 5), ann("download @ graph_backend.py:verify:158", 60, 8),
        api("cudaGraphLaunch", 13, 3, 1), api("cudaGraphLaunch", 113, 3, 2),
        api("cudaMemcpyAsync", 61, 2, 5), api("cudaStreamSynchronize", 63, 4, 6), api("cudaMemcpyAsync", 150, 1, 8),
        k("gemv", 20, 10, 1), k("rms", 30, 2, 1), k("gemv", 32, 10, 1),
        k("gemv", 120, 10, 2), k("rms", 140, 2, 2), k("gemv", 142, 10, 2),
        k("cupy_argmax", 50, 4, 9),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 62, "dur": 1, "args": {"correlation": 5}},
    ]


def test_replay_stats_on_a_cuda_shaped_trace():
    from gpu_profile import replay_stats

    r = replay_stats(_trace())
    assert r["replays_traced"] == 2 and r["kernels_per_replay"] == 3
    assert r["busy_us"] == 22 and r["span_us"] == 27 and r["idle_us"] == 5  # replay 2: 10 us between kernels
    assert r["kernels_under_5us"] == {"per_replay": 1, "us_per_replay": 2}
    assert r["top_kernels"][0] == {"kernel": "gemv", "per_replay": 2, "us_per_replay": 20}
    assert r["outside_graph_gpu_events"] == 2  # the CuPy kernel and the copy


def test_cycle_gpu_on_a_cuda_shaped_trace():
    from gpu_profile import cycle_gpu

    c = cycle_gpu(_trace())
    assert c["cycles_traced"] == 2 and c["wall_us_per_cycle"] == 100
    assert c["gpu_in_graphs_us"] == 22 and c["gpu_outside_graphs_us"] == 2.5 and c["gpu_idle_us"] == 75.5
    assert c["outside_graphs_by_name"][0] == {"name": "cupy_argmax", "per_cycle": 0.5, "us_per_cycle": 2}
    calls = {(a["code"], a["api"]): a["per_cycle"] for a in c["api_calls_by_code"]}
    assert calls[("download @ graph_backend.py:verify:158", "cudaStreamSynchronize")] == 0.5
    assert calls[("replay target", "cudaGraphLaunch")] == 0.5
    assert calls[("EngineCore (outside the labelled calls)", "cudaGraphLaunch")] == 0.5
    assert c["syncs_per_cycle"] == 0.5
