"""`dspark profile` and `dspark calibrate` on the tiny bundle: they write tables the engine
reads (and the default scheduler then uses), plots, and clear errors for what cannot work."""
from __future__ import annotations

import json
import shutil

import pytest

from dspark.runtime import Engine
from dspark.runtime.calibration import Calibration
from dspark.runtime.manifest import Manifest
from dspark.runtime.tools.cli import main
from dspark.runtime.throughput import SpsTable

PROMPTS = ["What is two plus two?", "Name a color.", "Count to five.", "Say hello.", "Why is the sky blue?",
           "Write a short poem.", "What is 3 times 4?", "Spell cat.", "Tell me a joke.", "List three fruits.",
           "What day comes after Monday?", "Give me a number.", "Describe the sea.", "What is a dog?",
           "Add 5 and 6.", "Who are you?"]


@pytest.fixture()
def bundle(tiny_bundle, tmp_path):
    path = tmp_path / "bundle"
    shutil.copytree(tiny_bundle.path, path)
    return path


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "train" / "prompts.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"question": p}) + "\n" for p in PROMPTS))
    return path


def test_profile_then_calibrate(bundle, data, capsys):
    assert main(["profile", "--bundle", str(bundle), "--max-slots", "3", "--context", "32", "--repeats", "1",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "SPS(B)" in out and "cycle at R = 3" in out
    table = SpsTable.load(bundle)
    gamma = 4
    assert len(table.sps) == 3 * (gamma + 1) and len(table.draft_s) == 3 and len(table.grid) == 3
    assert (bundle / "sps.png").stat().st_size > 0
    assert sorted(table.draft_by_graph) == ["int8-greedy"]  # what every CPU engine runs at T = 0
    assert table.draft_s == table.draft_by_graph["int8-greedy"]
    assert Engine.load(bundle, max_seq=128).sps.draft_s == table.draft_by_graph["int8-greedy"]
    assert main(["profile", "--bundle", str(bundle), "--max-slots", "3", "--context", "32", "--repeats", "1",
                 "--threads", "1", "--drafter-graph", "fp32"]) == 0  # an fp32 engine: the other kind is
    table = SpsTable.load(bundle)  # measured too, as what it runs at T = 0
    assert sorted(table.draft_by_graph) == ["fp32", "int8-greedy"] and table.draft_s == table.draft_by_graph["fp32"]
    assert Engine.load(bundle, max_seq=128, drafter_graph="fp32").sps.draft_s == table.draft_by_graph["fp32"]
    assert main(["calibrate", "--bundle", str(bundle), "--prompts", "16", "--max-new-tokens", "32",
                 "--data", str(data), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "ECE raw" in out and "held-out" in out
    cal = Calibration.load(bundle, Manifest.load(bundle))
    meta = json.loads((bundle / "calibration.json").read_text())["meta"]
    assert meta["fit_prompts"] == meta["held_out_prompts"] == 8 and len(cal.temperatures) == gamma
    assert (bundle / "calibration.png").stat().st_size > 0
    engine = Engine.load(bundle, max_seq=128)
    assert engine.scheduler("auto").name == "cost"  # the profile measured the drafter's cost
    assert engine.generate("Hi", max_new_tokens=8).token_ids == engine.generate("Hi", max_new_tokens=8,
                                                                                 scheduler="none").token_ids


def test_profile_that_cannot_fit_memory(bundle, capsys):
    assert main(["profile", "--bundle", str(bundle), "--max-slots", "10000000", "--context", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "memory" in err and "--max-slots" in err
    assert not (bundle / "sps.json").exists()


def test_calibrate_refuses_bench_prompts(bundle, tmp_path, capsys):
    bench = tmp_path / "bench" / "gsm8k.jsonl"
    bench.parent.mkdir()
    bench.write_text(json.dumps({"question": "What is 1 + 1?"}) + "\n")
    assert main(["calibrate", "--bundle", str(bundle), "--data", str(bench)]) == 2
    assert "bench" in capsys.readouterr().err
    assert not (bundle / "calibration.json").exists()


def test_a_profile_beside_other_work_warns_and_records_it(bundle):
    """Busy processes on every core while the profile runs: the table records the share of the CPU
    they took, and a warning says to profile again on a quiet machine (a table measured beside a
    compile once put the decode step at 4x its cost, docs/results.md)."""
    import os
    import subprocess
    import sys

    from dspark.runtime.tools.profile import BUSY_SHARE, ProfileConfig, profile

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        with pytest.warns(UserWarning, match="again on a quiet machine"):
            profile(bundle, ProfileConfig(max_slots=2, context=32, repeats=1, breakdown_tokens=4), threads=1)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert json.loads((bundle / "sps.json").read_text())["meta"]["other_cpu_share"] > BUSY_SHARE
