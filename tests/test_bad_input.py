"""Bad bundles and bad requests: a clear message and exit code 2 on the CLI, a typed
`DSparkError` in the Python API, and the process keeps serving afterwards."""
from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest
from factories import TINY_SPS

from dspark.runtime import BackendError, BundleError, DSparkError, Engine, InputError
from dspark.runtime.tools.cli import main

PROMPT = "Hello there, how are you?"
LONG_PROMPT = "Tell me everything about dragons, caves, the sea and the sky. " * 3  # > 64 chars = tokens


@pytest.fixture(scope="module")
def good(tiny_bundle):
    """An engine on the intact bundle and its answer, to check that serving goes on after errors."""
    engine = Engine.load(tiny_bundle.path, max_seq=128)
    return engine, engine.generate(PROMPT, max_new_tokens=16).token_ids


def still_serving(good) -> None:
    engine, expected = good
    assert engine.generate(PROMPT, max_new_tokens=16).token_ids == expected


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.err


def assert_cli_error(capsys, argv, fragment) -> str:
    rc, err = run_cli(capsys, argv)
    assert rc == 2, f"{argv}: exit code {rc}, stderr {err!r}"
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert fragment.lower() in err.lower(), f"{fragment!r} not in {err!r}"
    return err


# --- corrupt bundles -------------------------------------------------------------------------------

def _manifest(edit):
    def mutate(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        edit(m)
        (d / "manifest.json").write_text(json.dumps(m))
    return mutate


def _record_sizes(d: Path) -> None:
    """Rewrite the manifest's file sizes, so that the size check passes and the loader itself is tested."""
    _manifest(lambda m: m.update(files={p.name: p.stat().st_size for p in d.iterdir() if p.name != "manifest.json"}))(d)


def _truncate(name: str, keep_sizes: bool = False):
    def mutate(d: Path) -> None:
        p = d / name
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
        if keep_sizes:
            _record_sizes(d)
    return mutate


def _garbage(name: str):
    def mutate(d: Path) -> None:
        p = d / name
        p.write_bytes(bytes(range(256)) * (p.stat().st_size // 256) + b"\0" * (p.stat().st_size % 256))
    return mutate


def _append(name: str):
    def mutate(d: Path) -> None:
        with open(d / name, "ab") as f:
            f.write(b"\0" * 16)
    return mutate


def _set_ir_version(path: Path, version: int) -> None:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    model.ir_version = version
    onnx.save_model(model, str(path))
    _record_sizes(path.parent)


def _remove(name: str):
    return lambda d: (d / name).unlink()


BUNDLE_CASES = {
    # id: (mutation of a copy of the bundle, error type, fragment of the message)
    "missing_bundle_dir": (lambda d: shutil.rmtree(d), BundleError, "does not exist"),
    "dir_without_manifest": (_remove("manifest.json"), BundleError, "no manifest.json"),
    "missing_target_onnx": (_remove("target.onnx"), BundleError, "missing target.onnx"),
    "missing_weights": (_remove("weights.bin"), BundleError, "missing weights.bin"),
    "truncated_target_onnx": (_truncate("target.onnx"), BundleError, "the manifest says"),
    "corrupt_tokenizer_same_size": (_garbage("tokenizer.json"), BundleError, "tokenizer"),
    "file_size_mismatch": (_append("weights.bin"), BundleError, "the manifest says"),
    "other_bundle_format": (_manifest(lambda m: m.update(bundle_format=99, exporter_version="9.9.9")), BundleError,
                            "bundle_format is 99"),
    "format_3_bundle_before_shared_weights": (
        _manifest(lambda m: m.update(bundle_format=3, exporter_version="0.2.0")),
        BundleError, "bundle_format is 3 (exporter '0.2.0'), this runtime reads format 4 (exporter 0.3.0); re-export "
                     "it: `dspark export --out"),
    "target_disagrees_with_drafter": (_manifest(lambda m: m["target"].update(vocab_size=128)), BundleError,
                                      "vocab_size"),
    "graph_of_another_model": (_manifest(lambda m: m["target"].update(num_kv_heads=1)), BundleError,
                               "another model"),
    "manifest_not_json": (lambda d: (d / "manifest.json").write_text("{\"name\": "), BundleError, "not valid JSON"),
    "manifest_not_an_object": (lambda d: (d / "manifest.json").write_text("[1, 2]"), BundleError, "not a manifest"),
    "manifest_without_target": (_manifest(lambda m: m.pop("target")), BundleError, "malformed"),
    "sps_table_of_another_precision": (
        lambda d: TINY_SPS.save(d, {"precision": "gguf"}), BundleError, "measured on a gguf target"),
}
# Damaged contents of either target graph, each loaded through the --target-graph that reads it,
# and of the weights file every graph shares.
GRAPH_OF = {"target.onnx": "portable", "target_ort.onnx": "ort"}
for _file in GRAPH_OF:
    _stem = _file.replace(".onnx", "")
    BUNDLE_CASES[f"truncated_{_stem}_sizes_rewritten"] = (_truncate(_file, keep_sizes=True), BundleError, "cannot load")
    BUNDLE_CASES[f"truncated_weights_under_{_stem}_sizes_rewritten"] = (
        _truncate("weights.bin", keep_sizes=True), BundleError, "cannot load")
    BUNDLE_CASES[f"corrupt_{_stem}_same_size"] = (_garbage(_file), BundleError, "cannot load")
BUNDLE_CASES["graph_for_a_newer_onnxruntime"] = (  # onnxruntime 1.31 refuses IR version 14 the same way
    lambda d: _set_ir_version(d / "target_ort.onnx", 99), BundleError, "upgrade it: pip install 'onnxruntime>=")
BUNDLE_CASES["truncated_weights"] = (_truncate("weights.bin", keep_sizes=False), BundleError, "weights.bin has")
BUNDLE_CASES["corrupt_drafter_ort_same_size"] = (_garbage("drafter_ort.onnx"), BundleError, "cannot load")


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path) -> Path:
    d = tmp_path / "bundle"
    shutil.copytree(tiny_bundle.path, d)
    return d


@pytest.mark.parametrize("case", list(BUNDLE_CASES))
def test_bad_bundle(case, bundle_copy, good, capsys):
    mutate, error, fragment = BUNDLE_CASES[case]
    stems = sorted(GRAPH_OF, key=len, reverse=True)  # target_ort before target
    graph = next((GRAPH_OF[f] for f in stems if f"_{f.replace('.onnx', '')}_" in f"_{case}_"), "auto")
    mutate(bundle_copy)
    for command in ("generate", "chat"):
        argv = [command, "--bundle", str(bundle_copy), "--max-seq", "64", "--target-graph", graph]
        assert_cli_error(capsys, argv + (["--prompt", PROMPT] if command == "generate" else []), fragment)
    with pytest.raises(error) as e:
        Engine.load(bundle_copy, max_seq=64, target_graph=graph).generate(PROMPT, max_new_tokens=4)
    assert fragment.lower() in str(e.value).lower()
    still_serving(good)


# --- bad engine options ----------------------------------------------------------------------------

ENGINE_CASES = {
    # id: (CLI flags, Engine.load kwargs, error type, fragment)
    "unknown_backend": (["--backend", "tensorrt-llm"], {"backend": "tensorrt-llm"}, InputError, "unknown backend"),
    "unknown_provider": (["--provider", "tpu"], {"provider": "tpu"}, DSparkError, "unknown ONNX Runtime provider"),
    "max_seq_beyond_model": (["--max-seq", "100000"], {"max_seq": 100000}, InputError, "max_seq is 100000"),
    "max_seq_too_small": (["--max-seq", "1"], {"max_seq": 1}, InputError, "max_seq is 1"),
}
if "CUDAExecutionProvider" not in ort.get_available_providers():
    ENGINE_CASES["provider_not_in_build"] = (["--provider", "cuda"], {"provider": "cuda"}, BackendError,
                                             "not available")


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_bad_engine_option(case, tiny_bundle, good, capsys):
    flags, kwargs, error, fragment = ENGINE_CASES[case]
    argv = ["generate", "--bundle", str(tiny_bundle.path), "--prompt", PROMPT, "--max-seq", "64"]
    assert_cli_error(capsys, argv + flags, fragment)  # a later --max-seq overrides the first
    with pytest.raises(error, match=fragment):
        Engine.load(tiny_bundle.path, **{"max_seq": 64, **kwargs})
    still_serving(good)


# --- bad requests ----------------------------------------------------------------------------------

REQUEST_CASES = {
    # id: (CLI flags, Engine.generate kwargs (on an engine with max_seq 64), fragment)
    "prompt_longer_than_context": (["--prompt", LONG_PROMPT], {"prompt": LONG_PROMPT}, "exceeds the context"),
    "max_new_tokens_beyond_capacity": (["--max-new-tokens", "60"], {"max_new_tokens": 60}, "exceeds the context"),
    "max_new_tokens_zero": (["--max-new-tokens", "0"], {"max_new_tokens": 0}, "max_new_tokens is 0"),
    "max_new_tokens_negative": (["--max-new-tokens", "-5"], {"max_new_tokens": -5}, "max_new_tokens is -5"),
    "negative_temperature": (["--temperature", "-0.5"], {"temperature": -0.5}, "temperature is -0.5"),
    "nan_temperature": (["--temperature", "nan"], {"temperature": math.nan}, "temperature is nan"),
    "infinite_temperature": (["--temperature", "inf"], {"temperature": math.inf}, "temperature is inf"),
    "empty_raw_prompt": (["--raw", "--prompt", ""], {"prompt": "", "chat": False}, "prompt is empty"),
    "negative_seed": (["--seed", "-5"], {"seed": -5}, "seed is -5, expected an integer >= 0"),
    "empty_stop_string": (["--stop", ""], {"stop": [""]}, "stop is"),
}


@pytest.fixture(scope="module")
def small_engine(tiny_bundle):
    return Engine.load(tiny_bundle.path, max_seq=64)


@pytest.mark.parametrize("case", list(REQUEST_CASES))
def test_bad_request(case, tiny_bundle, small_engine, good, capsys):
    flags, kwargs, fragment = REQUEST_CASES[case]
    argv = ["generate", "--bundle", str(tiny_bundle.path), "--max-seq", "64", "--max-new-tokens", "8"]
    if "--prompt" not in flags:
        argv += ["--prompt", "Hi"]
    assert_cli_error(capsys, argv + flags, fragment)
    with pytest.raises(InputError, match=fragment.replace("(", r"\(")):
        small_engine.generate(**{"prompt": "Hi", "max_new_tokens": 8, **kwargs})
    small_engine.generate("Hi", max_new_tokens=8)  # the engine that refused keeps serving
    still_serving(good)


def test_unknown_scheduler(tiny_bundle, good, small_engine, capsys):
    with pytest.raises(InputError, match="unknown scheduler"):
        small_engine.generate("Hi", max_new_tokens=4, scheduler="eagle")
    with pytest.raises(SystemExit) as e:  # argparse's own usage error
        main(["generate", "--bundle", str(tiny_bundle.path), "--prompt", "Hi", "--scheduler", "eagle"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
    still_serving(good)


def test_chat_reports_an_error_and_keeps_serving(tiny_bundle, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{LONG_PROMPT}\nHi\n/exit\n"))
    capsys.readouterr()
    rc = main(["chat", "--bundle", str(tiny_bundle.path), "--max-seq", "64", "--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "error:" in err and "exceeds the context" in err
    assert "τ =" in err  # the second turn was answered


def test_good_request_after_errors_on_the_cli(tiny_bundle, good, capsys):
    rc = main(["generate", "--bundle", str(tiny_bundle.path), "--prompt", PROMPT, "--max-new-tokens", "16",
               "--max-seq", "128", "--json"])
    out = capsys.readouterr().out
    assert rc == 0 and json.loads(out)["token_ids"] == good[1]


def test_compare_warms_both_contenders_up_first(tiny_bundle, capsys, monkeypatch):
    """`--compare` times DSpark and the target alone only after each ran once on the prompt:
    otherwise the first contender alone pays the engine's first calls of each shape."""
    calls = []
    generate = Engine.generate

    def recording(self, prompt, **kwargs):
        calls.append((kwargs["scheduler"], kwargs["max_new_tokens"]))
        return generate(self, prompt, **kwargs)

    monkeypatch.setattr(Engine, "generate", recording)
    rc = main(["generate", "--bundle", str(tiny_bundle.path), "--prompt", PROMPT, "--max-new-tokens", "24",
               "--max-seq", "128", "--scheduler", "fixed", "--compare"])
    err = capsys.readouterr().err
    assert rc == 0 and "outputs identical" in err and "speedup" in err
    assert calls == [("fixed", 16), ("none", 16), ("fixed", 24), ("none", 24)]


# --- help ------------------------------------------------------------------------------------------

def test_help(capsys):
    for argv, words in ((["--help"], ["export", "generate", "chat", "--bundle"]),
                        (["generate", "--help"], ["--bundle", "--prompt", "--max-new-tokens", "--temperature",
                                                  "--seed", "--no-speculation", "--json", "--raw", "--compare",
                                                  "--stop", "--max-seq", "--provider"]),
                        (["chat", "--help"], ["--bundle", "/exit"]),
                        (["export", "--help"], ["--out", "--target", "--drafter"])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        out = capsys.readouterr().out
        assert e.value.code == 0, argv
        for w in words:
            assert w in out, f"{w!r} missing from `dspark {' '.join(argv)}`"
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and "required" in capsys.readouterr().err


def test_console_script_help():
    exe = shutil.which("dspark") or os.path.join(os.path.dirname(sys.executable), "dspark")
    if not os.path.exists(exe):
        pytest.skip("the dspark console script is not installed")
    for argv in ([], ["generate"]):
        p = subprocess.run([exe, *argv, "--help"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "--bundle" in p.stdout, p.stderr
