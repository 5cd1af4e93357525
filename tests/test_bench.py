"""`dspark bench`: repetition-loop accounting, domain means, and the command end to end on the
tiny bundle (τ in the table equals the engine's own per-cycle counts)."""
import json

import numpy as np
import pytest

from dspark.runtime import Engine
from dspark.runtime.tools.bench import domain_means, loop_cycles, loop_tokens, wilson
from dspark.runtime.tools.cli import main


def test_loop_tokens_marks_a_repeated_window():
    seq = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert loop_tokens(seq, window=3).tolist() == [False] * 6 + [True] * 4
    assert not loop_tokens(list(range(50)), window=3).any()


def test_loop_cycles_needs_every_token_of_the_cycle_inside():
    seq = [9, 1, 2, 3, 1, 2, 3, 1, 2]  # token 0 from prefill; with window 3, tokens 6.. repeat
    # cycles commit 3, 2, 3 tokens: positions 1-3, 4-5, 6-8
    assert loop_cycles(seq, [3, 2, 3], window=3).tolist() == [False, False, True]
    # the last cycle cut by the budget: it committed only up to the end of the output
    assert loop_cycles(seq, [3, 2, 8], window=3).tolist() == [False, False, True]


def test_wilson_interval():
    lo, hi = wilson(np.array([5.0, 0.0]), np.array([10.0, 20.0]))
    assert lo == pytest.approx([0.2366, 0.0], abs=1e-4) and hi == pytest.approx([0.7634, 0.1611], abs=1e-4)


def test_domain_means_and_macro():
    dm = domain_means({"gsm8k": 3.0, "math500": 1.0, "humaneval": 2.0, "mt-bench": 4.0})
    assert dm == {"math": 2.0, "code": 2.0, "chat": 4.0, "macro": pytest.approx(8 / 3)}


def _write_bench(d, names, n):
    d.mkdir()
    for name in names:
        lines = [json.dumps({"turns": [f"say {name} {i} twice", "again"]}) for i in range(n)]
        (d / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def test_bench_command_on_the_tiny_bundle(tiny_bundle, tmp_path, capsys):
    data, out = tmp_path / "bench", tmp_path / "out"
    _write_bench(data, ["gsm8k", "mbpp"], 2)
    argv = ["bench", "--bundle", str(tiny_bundle.path), "--label", "A", "--bundle", str(tiny_bundle.path),
            "--label", "B", "--datasets", "gsm8k", "mbpp", "--prompts", "2", "--temperatures", "0", "1",
            "--max-new-tokens", "20", "--data", str(data), "--out", str(out), "--threads", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| A | 0 |" in printed and "| B | 1 |" in printed and "repetition loops" in printed
    assert (out / "acceptance.png").stat().st_size > 0
    report = json.loads((out / "bench.json").read_text())
    cell = report["results"]["A"]["0"]["gsm8k"]

    engine = Engine.load(tiny_bundle.path, threads=1)  # τ recomputed from the engine's own cycles
    emitted = []
    for i in range(2):
        r = engine.generate(f"say gsm8k {i} twice", max_new_tokens=20, temperature=0.0, seed=i, scheduler="fixed")
        emitted += r.stats.emitted
    assert cell["cycles"] == len(emitted) and cell["tau"] == pytest.approx(np.mean(emitted))
    assert cell["tau"] > 1.2  # the tiny bundle's copy drafter really is accepted at T = 0
    assert report["results"]["A"] == report["results"]["B"]  # same bundle, same seeds: same numbers


@pytest.mark.parametrize("case, message", [
    (["--datasets", "nope"], "unknown dataset"),
    (["--datasets", "math500"], "no such benchmark file"),
    (["--datasets", "gsm8k", "--label", "x", "--label", "y"], "2 --label for 1 --bundle"),
    (["--datasets", "humaneval"], "expected a JSON object"),
])
def test_bench_bad_input(case, message, tiny_bundle, tmp_path, capsys):
    data = tmp_path / "bench"
    _write_bench(data, ["gsm8k"], 1)
    (data / "humaneval.jsonl").write_text("not json\n")
    argv = ["bench", "--bundle", str(tiny_bundle.path), "--data", str(data), "--out", str(tmp_path / "o"), *case]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bench_prompt_file_of_training_records(tiny_bundle, tmp_path, capsys):
    """--prompt-file measures any prompt file as one more set ("other" domain), from record --skip on."""
    train = tmp_path / "heldout-train.jsonl"
    train.write_text("\n".join(json.dumps({"question": f"say {i} twice", "answer": "never read"}) for i in range(4)) + "\n")
    out = tmp_path / "out"
    argv = ["bench", "--bundle", str(tiny_bundle.path), "--label", "A", "--prompt-file", str(train), "--skip", "1",
            "--prompts", "2", "--temperatures", "0", "--max-new-tokens", "16", "--out", str(out), "--threads", "1"]
    assert main(argv) == 0
    assert "| drafter | T | heldout-train | other | macro |" in capsys.readouterr().out
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["datasets"] == ["heldout-train"] and report["settings"]["skip"] == 1
    cell = report["results"]["A"]["0"]["heldout-train"]

    engine = Engine.load(tiny_bundle.path, threads=1)  # the prompts were records 1 and 2
    emitted = []
    for i, prompt in enumerate(["say 1 twice", "say 2 twice"]):
        emitted += engine.generate(prompt, max_new_tokens=16, temperature=0.0, seed=i, scheduler="fixed").stats.emitted
    assert cell["prompts"] == 2 and cell["cycles"] == len(emitted) and cell["tau"] == pytest.approx(np.mean(emitted))


@pytest.mark.parametrize("case, message", [
    (["--prompt-file", "missing.jsonl"], "no such file"),
    (["--prompt-file", "train.jsonl", "--skip", "5"], "no prompts left after skipping"),
    (["--prompt-file", "gsm8k.jsonl", "--datasets", "gsm8k"], "two prompt sets are named 'gsm8k'"),
    (["--prompt-file", "answers.jsonl"], "or a training record"),
    (["--datasets", "gsm8k", "--skip", "-1"], "--skip >= 0"),
])
def test_bench_prompt_file_bad_input(case, message, tiny_bundle, tmp_path, capsys, monkeypatch):
    data = tmp_path / "bench"
    _write_bench(data, ["gsm8k"], 1)
    monkeypatch.chdir(data)
    (data / "train.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    (data / "answers.jsonl").write_text(json.dumps({"answer": "a"}) + "\n")
    argv = ["bench", "--bundle", str(tiny_bundle.path), "--data", str(data), "--out", str(tmp_path / "o"), *case]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_line_separator_inside_a_record_does_not_end_it(tmp_path):
    """JSON Lines ends records at "\\n" only; a U+2028 inside a string (arena-hard-v2 has one) is text."""
    from dspark.runtime.tools.prompts import read_prompt_file

    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": ["one\u2028two"]}\n\n{"turns": ["three"]}\n', encoding="utf-8")
    assert read_prompt_file(path, 2) == ["one\u2028two", "three"]
