"""scripts/gpu_train.sh: the drafter's GPU route, which a lent GPU runs. Here, without a GPU: it
must say so and exit 2; rehearsed at tiny scale on the CPU (--device cpu, a tiny target and
drafter) it must run every stage (generate, train warm-started over a draft vocabulary, export)
and return a checkpoint and the responses in parts that `--unpack` checks and restores; with real
weights prepared (.gpu/), a missing part of the GGUF stops it with exit 3 before anything runs."""
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from factories import write_tiny_hf_target

from dspark.export import load_drafter, load_target, save_drafter
from dspark.export.train_data import read_responses
from dspark.export.training import TrainConfig, build_drafter

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path, *args, root=ROOT):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1", "GGUF_DIR": str(tmp_path / "gguf"),
           "WHEEL_SITE": str(tmp_path / "site")}
    return subprocess.run(["bash", str(root / "scripts" / "gpu_train.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny HF target, a drafter checkpoint for it (the warm start) and three prompts."""
    root = tmp_path_factory.mktemp("gpu_train")
    write_tiny_hf_target(root / "target")
    cfg = TrainConfig(num_layers=1, target_layer_ids=(-1, 1, 2), markov_rank=8, block_size=4, mask_token_id=3)
    save_drafter(build_drafter(load_target(root / "target").model, cfg), root / "init", dtype=torch.bfloat16)
    (root / "p.jsonl").write_text("".join(json.dumps({"question": q}) + "\n"
                                          for q in ["What is 2+2?", "Name a color.", "Say hi"]))
    return root


def test_without_a_gpu_it_says_so(tmp_path, tiny):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = run(tmp_path, "--target", str(tiny / "target"), "--prompts", str(tiny / "p.jsonl"))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no GPU" in p.stdout + p.stderr
    assert "no GPU" in json.loads((tmp_path / "out" / "gpu_train.json").read_text())["status"]


def test_rehearsal_at_tiny_scale_on_the_cpu(tmp_path, tiny):
    p = run(tmp_path, "--target", str(tiny / "target"), "--prompts", str(tiny / "p.jsonl"), "--device", "cpu",
            "--work", str(tmp_path / "work"), "--init-from", str(tiny / "init"), "--draft-vocab", "24",
            "--gen-minutes", "0.001", "--gen-batch", "2", "--max-new-tokens", "12", "--train-minutes", "0.05",
            "--train-batch", "2", "--steps", "1000000", "--warmup", "0")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "out"
    rep = json.loads((out / "gpu_train.json").read_text())
    assert rep["ok"] and set(rep["stages"]) == {"generate", "train", "export"}
    assert rep["data"]["responses"] == rep["data"]["generated_responses"] == 2  # one batch, then the budget stops it
    assert 0 < rep["train"]["steps"] < 1000000 and rep["train"]["sec_per_step"] > 0  # stopped by its budget
    assert "int8" in rep["target_arithmetic"]
    assert all((out / f).stat().st_size <= 16 * 1024 * 1024 for f in rep["files"]) and len(rep["files"]) + 4 <= 8

    back = tmp_path / "back"
    script = ["python", str(ROOT / "scripts" / "gpu_train.py")]
    subprocess.run([*script, "--unpack", str(out), "--to", str(back)], check=True, timeout=120)
    loaded = load_target(tiny / "target")
    drafter = load_drafter(back / "drafter", embeddings=(loaded.model.embed_tokens.weight, loaded.model.lm_head.weight))
    start = load_drafter(tiny / "init", embeddings=(loaded.model.embed_tokens.weight, loaded.model.lm_head.weight))
    moved = [not torch.equal(a, b) for a, b in zip(drafter.parameters(), start.parameters())]
    assert any(moved)  # trained from the warm start
    assert [r["prompt"] for r in read_responses(back / "responses")] == \
        [r["prompt"] for r in read_responses(tmp_path / "work" / "data" / "responses")]
    assert (back / "drafter" / "token_counts.json").exists()  # `dspark export --draft-vocab` picks the trained ids

    (out / "result.tar.part00").write_bytes(b"damaged")
    bad = subprocess.run([*script, "--unpack", str(out), "--to", str(tmp_path / "bad")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "sha256 differs" in bad.stderr


def test_it_trains_on_responses_already_written(tmp_path, tiny):
    """--data DIR --gen-minutes 0: the responses of DIR (xz shards, as committed) are trained on,
    nothing is generated, and none of them travels back; DIR of another target, an empty DIR and
    nothing to train on are refused with a message."""
    import lzma

    data = tmp_path / "data"
    subprocess.run(["python", str(ROOT / "scripts" / "train_drafter.py"), "generate", "--target", str(tiny / "target"),
                    "--prompts", str(tiny / "p.jsonl"), "--self-prompts", "0", "--temperatures", "0",
                    "--max-new-tokens", "6", "--data", str(data)], check=True, timeout=300)
    for shard in (data / "responses").glob("*.jsonl"):
        shard.with_suffix(".jsonl.xz").write_bytes(lzma.compress(shard.read_bytes()))
        shard.unlink()
    common = ["--target", str(tiny / "target"), "--prompts", str(tiny / "p.jsonl"), "--device", "cpu",
              "--work", str(tmp_path / "work"), "--init-from", str(tiny / "init"), "--draft-vocab", "24",
              "--train-minutes", "0.05", "--train-batch", "2", "--steps", "1000000", "--warmup", "0"]
    p = run(tmp_path, *common, "--data", str(data), "--gen-minutes", "0")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "gpu_train.json").read_text())
    assert set(rep["stages"]) == {"train", "export"}
    assert rep["data"]["responses"] == 3 and rep["data"]["generated_responses"] == 0
    assert rep["data"]["given"] == str(data) and rep["train"]["steps"] > 0
    back = tmp_path / "back"
    subprocess.run(["python", str(ROOT / "scripts" / "gpu_train.py"), "--unpack", str(tmp_path / "out"),
                    "--to", str(back)], check=True, timeout=120)
    assert (back / "drafter").is_dir() and not list(back.glob("responses/*"))

    other = tmp_path / "other"
    shutil.copytree(data, other)
    (other / "target.json").write_text(json.dumps({"target": "another.gguf", "sha256": "0" * 64}))
    p = run(tmp_path, *common, "--data", str(other), "--gen-minutes", "0", "--work", str(tmp_path / "work2"))
    assert p.returncode == 1
    assert "another target" in json.loads((tmp_path / "out" / "gpu_train.json").read_text())["status"]
    (tmp_path / "empty").mkdir()
    for args, says in ((["--data", str(tmp_path / "empty")], "no responses"), (["--gen-minutes", "0"], "nothing to train on")):
        p = run(tmp_path, *common, *args)
        assert p.returncode == 2 and says in p.stdout + p.stderr, p.stdout + p.stderr


def test_a_missing_part_of_the_gguf_stops_it(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", root / "scripts")
    gpu = root / ".gpu"
    gpu.mkdir()
    parts = [b"first part", b"second part", b"third part", b"fourth part"]
    lines = [f"{hashlib.sha256(p).hexdigest()}  gguf.part{i + 1}" for i, p in enumerate(parts)]
    lines.append(f"{hashlib.sha256(b''.join(parts)).hexdigest()}  target.gguf")
    (gpu / "gguf.sha256").write_text("\n".join(lines) + "\n")
    for i in (0, 1, 3):
        (gpu / f"gguf.part{i + 1}").write_bytes(parts[i])
    p = run(tmp_path, root=root)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "gguf.part3 is missing" in p.stdout + p.stderr and "4 parts" in p.stdout + p.stderr
    assert not (tmp_path / "gguf" / "target.gguf").exists() and not (tmp_path / "out" / "gpu_train.json").exists()
