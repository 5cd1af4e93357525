"""scripts/bench_serving.py end to end on the tiny profiled bundle: it starts `dspark serve` for every
contender (auto and none, each with and without chunked prefill for the long-prompt mode), runs
every load point over the benchmark prompt sets of ../shared/data, and writes the JSON and the
PNG. Only the shape and sanity of the figures are checked, never a speed."""
import importlib.util
import json
import socket
import sys
import time
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
SETS = "gsm8k,humaneval,mt-bench"  # a math, a code and a chat set
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def _script():
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "scripts" / "bench_serving.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up
    spec.loader.exec_module(script)
    return script


bench_serving = _script()


@pytest.fixture(scope="module")
def data() -> Path:
    assert (DATA / "bench").is_dir(), f"the benchmark prompt sets are missing: {DATA / 'bench'} (../shared/data)"
    return DATA


def test_the_request_sequence_is_a_seeded_equal_mix(data, tmp_path):
    cfg = bench_serving.parse(["--bundle", "b", "--data-dir", str(data), "--datasets", SETS, "--out",
                               str(tmp_path / "x.json")])
    seq, kept = bench_serving.request_sequence(cfg, 30)
    assert seq == bench_serving.request_sequence(cfg, 30)[0] and set(kept) == set(SETS.split(","))
    sets = {name: set(bench_serving.bench_prompts(name, sys.maxsize, data_dir=data / "bench")) for name in kept}
    assert [sum(p in sets[name] for p in seq) for name in kept] == [10, 10, 10]
    other = bench_serving.parse(["--bundle", "b", "--data-dir", str(data), "--datasets", SETS, "--seed", "1",
                                 "--out", str(tmp_path / "x.json")])
    assert bench_serving.request_sequence(other, 30)[0] != seq


def test_every_bench_set_is_read_by_default(data, tmp_path):
    cfg = bench_serving.parse(["--bundle", "b", "--data-dir", str(data), "--out", str(tmp_path / "x.json")])
    assert len(cfg.datasets) == len(list((data / "bench").glob("*.jsonl")))
    assert all(bench_serving.request_sequence(cfg, 8)[1].values())


def _ordered(p: dict) -> bool:
    return 0 < p["p50"] <= p["p90"] <= p["p99"]


def test_contenders_at_every_load_point(profiled, data, tmp_path, capsys):
    out = tmp_path / "out" / "bench.json"
    argv = ["--bundle", str(profiled), "--data-dir", str(data), "--datasets", SETS, "--contenders", "auto,none",
            "--concurrency", "1,2", "--request-rates", "4", "--rates-from-saturation", "0.5", "--num-requests", "4",
            "--max-tokens", "16", "--max-prompt-chars", "400", "--warmup", "1", "--slots", "3", "--max-queue", "64",
            "--server-args", "--threads 1", "--long-prompt-tokens", "120", "--long-prompt-concurrency", "2",
            "--long-prompt-interval", "0.2", "--long-prompt-max-tokens", "4", "--prefill-chunks", "32,0",
            "--request-timeout", "60", "--max-seconds", "300", "--out", str(out)]
    assert bench_serving.main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert not report["cut_off"]
    head = report["header"]
    assert "bench_serving.py" in head["command"] and head["command"] in printed and head["date_utc"] in printed
    assert set(head["cpu_flags"]) == {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"} and head["cpu_model"]

    half = float(f"{0.5 * report['saturation']['req_s']:.3g}")
    assert report["saturation"]["contender"] == "none chunk=32" and report["rates"] == [4.0] + [half] * (half != 4)
    standard = {"c=1", "c=2", "rate=4/s", f"rate={half:.3g}/s", "long c=2"}
    contenders = report["contenders"]
    assert list(contenders)[0] == "none chunk=32"  # it sets the rates of the others
    long_only = {"long c=2"}
    assert {name: set(c["points"]) for name, c in contenders.items()} == {
        "auto chunk=32": standard, "none chunk=32": standard, "auto chunk=0": long_only, "none chunk=0": long_only}
    for name, c in contenders.items():
        assert f"--scheduler {c['scheduler']}" in c["server_command"]
        assert f"--prefill-chunk {c['prefill_chunk']}" in c["server_command"]
        for point, s in c["points"].items():
            assert s["requests"] == 4 and s["completed"] == 4 and s["failed"] == 0 and not s["truncated"], (name, s)
            assert s["output_tokens"] > 0 and s["request_throughput"] > 0 and s["output_throughput"] > 0
            assert all(_ordered(s[m]) for m in METRICS), (name, point, {m: s[m] for m in METRICS})
            if point.startswith("long"):
                assert s["long"]["sent"] >= 1 and s["long"]["failed"] == 0 and s["long"]["prompt_tokens_mean"] > 100
    for point in standard - long_only:
        assert set(report["ratios"][point]) == {"auto chunk=32 / none chunk=32"}
    assert set(report["ratios"]["long c=2"]) == {"auto chunk=32 / none chunk=32", "auto chunk=0 / none chunk=0"}
    assert "DSpark / none" in printed
    assert out.with_suffix(".png").stat().st_size > 0
    assert (out.parent / "bench.auto_chunk32.log").exists()


def test_a_url_without_a_server_fails_at_once(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    t0 = time.monotonic()
    assert bench_serving.main(["--url", f"http://127.0.0.1:{port}/v1", "--out", str(tmp_path / "x.json")]) == 2
    assert time.monotonic() - t0 < 10
    assert f"no server answers at http://127.0.0.1:{port}/health" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit) as e:  # loopback only
        bench_serving.main(["--url", "http://example.com:8000", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "loopback only" in capsys.readouterr().err


def test_a_server_that_does_not_start_is_reported(data, tmp_path, capsys):
    argv = ["--bundle", str(tmp_path / "no-bundle"), "--data-dir", str(data), "--datasets", SETS, "--concurrency", "1",
            "--num-requests", "1", "--out", str(tmp_path / "x.json")]
    assert bench_serving.main(argv) == 2
    err = capsys.readouterr().err
    assert "the server exited with 2" in err and "no-bundle" in err, err
