"""scripts/gpu_check.sh: the script a lent GPU runs. Here, without a GPU: it must say so and
exit 2; its --smoke mode (tiny model, CPU stand-in device) must run every check but the CuPy
one end to end, concurrent requests included, so that the GPU run is unlikely to fail on a plain
bug; and with real weights prepared (.gpu/, scripts/gpu_prep.sh) a missing or corrupt part of
the GGUF must stop it with exit 3 before anything runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path, *args, root=ROOT):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1", "GGUF_DIR": str(tmp_path / "gguf"),
           "WHEEL_SITE": str(tmp_path / "site")}
    return subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_without_a_gpu_it_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = run(tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no GPU: torch.cuda.is_available() is False" in p.stdout + p.stderr
    assert "no GPU" in json.loads((tmp_path / "out" / "gpu_check.json").read_text())["status"]


def test_smoke_mode_runs_every_check(tmp_path):
    p = run(tmp_path, "--smoke")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert res["ok"] and res["identity"]["ok"] and set(res["sps"]) >= {"batch1/graphs", "batch1/eager", "batch4/graphs"}
    assert res["timing"]["graphs"]["tau"] > 1  # the copy drafter is accepted: both loop paths ran
    c = res["concurrency"]
    assert c["ok"] and c["requests"] == 4 and c["R4"]["dspark"]["identical_to_solo"] >= 3 and c["R4"]["dspark"]["tau"] > 1
    assert res["throughput"]["mean"]["tau"] > 1 and (tmp_path / "out" / "gpu_check.log").exists()
    assert any(k.startswith("target B=4 S=") for k in res["graph_time"])  # replays timed at the largest batch


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_incomplete_real_weights_stop_it(tmp_path, damage):
    """A checkout whose .gpu/ lacks a part of the GGUF, or holds a corrupt one, exits 3 with a
    message naming the problem, before any check runs."""
    import hashlib
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", root / "scripts")
    gpu = root / ".gpu"
    gpu.mkdir()
    parts = [b"first part", b"second part", b"third part"]
    lines = [f"{hashlib.sha256(p).hexdigest()}  gguf.part{i + 1}" for i, p in enumerate(parts)]
    lines.append(f"{hashlib.sha256(b''.join(parts)).hexdigest()}  target.gguf")
    (gpu / "gguf.sha256").write_text("\n".join(lines) + "\n")
    for i, p in enumerate(parts):
        if not (damage == "missing" and i == 1):
            (gpu / f"gguf.part{i + 1}").write_bytes(p + (b"!" if damage == "corrupt" and i == 2 else b""))
    p = run(tmp_path, root=root)
    assert p.returncode == 3, p.stdout + p.stderr
    want = "gguf.part2 is missing" if damage == "missing" else "does not match its sha256"
    assert want in p.stdout + p.stderr and not (tmp_path / "gguf" / "target.gguf").exists()


def test_parts_carried_in_three_calls_are_stashed(tmp_path):
    """Each device call that carries .gpu/ replaces the folder: the first two calls stash their
    part with --stash, and the third finds all three (each verified) and reassembles them."""
    import hashlib
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", root / "scripts")
    parts = [b"first part", b"second part", b"third part"]
    lines = [f"{hashlib.sha256(p).hexdigest()}  gguf.part{i + 1}" for i, p in enumerate(parts)]
    lines.append(f"{'0' * 64}  target.gguf")  # stops the check right after reassembly
    for i, part in enumerate(parts):
        gpu = root / ".gpu"
        shutil.rmtree(gpu, ignore_errors=True)  # what a call carrying .gpu/ does on the device
        gpu.mkdir()
        (gpu / "gguf.sha256").write_text("\n".join(lines) + "\n")
        (gpu / f"gguf.part{i + 1}").write_bytes(part)
        p = run(tmp_path, *(["--stash"] if i < 2 else []), root=root)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "the reassembled GGUF does not match its sha256" in p.stdout + p.stderr
    assert (tmp_path / "gguf" / "parts" / "gguf.part1").read_bytes() == parts[0]
