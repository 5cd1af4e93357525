"""scripts/gpu_check.sh: the script a lent GPU runs. Here, without a GPU: it must say so and
exit 2; and its --smoke mode (tiny model, CPU stand-in device) must run every check but the
CuPy one end to end, so that the GPU run is unlikely to fail on a plain bug."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path, *args):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_without_a_gpu_it_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = run(tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no GPU: torch.cuda.is_available() is False" in p.stdout + p.stderr
    assert "no GPU" in json.loads((tmp_path / "gpu_check.json").read_text())["status"]


def test_smoke_mode_runs_every_check(tmp_path):
    p = run(tmp_path, "--smoke", "--max-new-tokens", "16")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["ok"] and res["identity"]["ok"] and set(res["sps"]) >= {"graphs", "eager", "ok"}
    assert res["timing"]["graphs"]["tau"] > 1  # the copy drafter is accepted: both loop paths ran
    assert (tmp_path / "gpu_check.log").exists()
