"""tests/fake_tensorrt.py against the real `tensorrt` module: every name in the fake's `REAL_API`
exists in TensorRT's Python bindings, as the same kind of thing (class, method, property, enum
member), and every method takes the parameters the bindings declare (their pybind11 signatures),
so the calls our builder and backend make on the fake are calls TensorRT 11 has.

The real module comes from `import tensorrt`, or from the site directory DSPARK_REAL_TENSORRT
names, or else from a site this test makes with scripts/tensorrt_api_site.sh (PyPI's
tensorrt-cu13 bindings, 1.2 MB, over stub native libraries: NVIDIA's own come from
pypi.nvidia.com, which this project's machines cannot reach; about 10 s; needs pip, gcc and nm).
Skipped, with the reason, where none of these works. This checks names and signatures only;
nothing is built or run."""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from types import SimpleNamespace

import pytest

import fake_tensorrt

SITE = os.environ.get("DSPARK_REAL_TENSORRT")


def _stub_site(tmp_path_factory) -> str | None:
    """A site made by scripts/tensorrt_api_site.sh, or None (with why on stderr)."""
    import subprocess
    from pathlib import Path

    site = tmp_path_factory.mktemp("tensorrt_api_site")
    script = Path(__file__).resolve().parents[1] / "scripts" / "tensorrt_api_site.sh"
    try:
        done = subprocess.run(["bash", str(script), str(site)], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"tensorrt_api_site.sh: {e}", file=sys.stderr)
        return None
    if done.returncode:
        print(f"tensorrt_api_site.sh failed: {done.stderr[-2000:]}", file=sys.stderr)
        return None
    return str(site)


@pytest.fixture(scope="module")
def real_trt(tmp_path_factory):
    before, path = set(sys.modules), list(sys.path)
    try:
        trt = importlib.import_module("tensorrt") if not SITE else None
    except ImportError:
        trt = None
    if trt is fake_tensorrt:  # another test's stand-in, not the real module
        trt = None
    site = SITE or (None if trt is not None else _stub_site(tmp_path_factory))
    if trt is None and site is None:
        pytest.skip("the real tensorrt module is not installed and scripts/tensorrt_api_site.sh could not make "
                    "a site of its bindings here (no PyPI, gcc or nm?): install tensorrt-cu13, or point "
                    "DSPARK_REAL_TENSORRT at such a site")
    if trt is None:
        sys.path.insert(0, site)
        try:
            trt = importlib.import_module("tensorrt")
        except ImportError as e:
            pytest.skip(f"the tensorrt bindings in {site} do not import here ({e})")
        finally:
            sys.path[:] = path
    yield trt
    for name in set(sys.modules) - before:  # later tests import the fake, or nothing, as before
        if name.split(".")[0] in ("tensorrt", "tensorrt_bindings"):
            del sys.modules[name]


OPEN, CLOSE = "[(<", "])>"


def split_params(params: str) -> list[str]:
    """Parameter names of a pybind11 signature's parameter list (types hold commas in brackets,
    defaults such as <Severity.WARNING: 2> hold colons)."""
    names, depth, start = [], 0, 0
    for i, c in enumerate(params + ","):
        depth += (c in OPEN) - (c in CLOSE)
        if c == "," and depth == 0:
            item = params[start:i].strip()
            if item:
                names.append(item.split(":")[0].split("=")[0].strip())
            start = i + 1
    return [n for n in names if n != "self"]


def real_signatures(obj, name: str) -> list[list[str]]:
    """Every overload's parameter names, from the docstring pybind11 writes (or inspect, for the
    module's Python functions such as nptype)."""
    if inspect.isfunction(obj):
        return [[p for p in inspect.signature(obj).parameters if p != "self"]]
    lines = re.findall(rf"^(?:\d+\. )?{re.escape(name)}\((.*)\)(?: -> .*)?$", obj.__doc__ or "", re.MULTILINE)
    return [split_params(line) for line in lines if "*args" not in line]


def fake_params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def member_problems(name: str, fake, real) -> list[str]:
    if isinstance(fake, SimpleNamespace):  # an enum
        members = getattr(real, "__members__", {})
        return [f"{name}.{m} is not a member of tensorrt.{name}" for m in vars(fake) if m not in members]
    if inspect.isfunction(fake):
        sigs = real_signatures(real, name)
        return [] if fake_params(fake) in sigs else [f"{name}{fake_params(fake)}: tensorrt has {sigs}"]
    problems = []
    for attr, value in vars(fake).items():
        if attr.startswith("_") and attr != "__init__":
            continue
        where = f"{name}.{attr}"
        if attr == "__init__" and "__init__(" not in (real.__init__.__doc__ or ""):
            continue  # tensorrt makes these itself (no Python constructor): the fake's takes what it needs
        if not hasattr(real, attr):
            problems.append(f"{where}: tensorrt.{name} has no {attr}")
        elif isinstance(value, property) != isinstance(inspect.getattr_static(real, attr), property):
            problems.append(f"{where}: a property in only one of the fake and tensorrt")
        elif inspect.isfunction(value):
            sigs = real_signatures(getattr(real, attr), attr)
            if fake_params(value) not in sigs:
                problems.append(f"{where}{fake_params(value)}: tensorrt has {sigs}")
    return problems


def test_the_fake_follows_the_real_tensorrt_api(real_trt):
    assert real_trt.__version__.split(".")[0] == fake_tensorrt.__version__.split(".")[0], \
        f"the fake follows TensorRT {fake_tensorrt.__version__}, this is {real_trt.__version__}"
    problems = []
    for name in fake_tensorrt.REAL_API:
        if name == "__version__":
            continue
        if not hasattr(real_trt, name):
            problems.append(f"tensorrt has no {name}")
            continue
        problems += member_problems(name, getattr(fake_tensorrt, name), getattr(real_trt, name))
    assert problems == [], "\n".join(problems)


def test_the_api_check_sees_a_wrong_name_or_parameter(real_trt):
    """The check itself: TensorRT 10's names, gone in 11, are reported."""
    class ICudaEngine:
        device_memory_size = property(lambda self: 0)  # 11: device_memory_size_v2 only

        def get_tensor_name(self, i): ...  # the bindings call it index

    problems = member_problems("ICudaEngine", ICudaEngine, real_trt.ICudaEngine)
    assert any("has no device_memory_size" in p for p in problems)
    assert any("get_tensor_name['i']: tensorrt has [['index']]" in p for p in problems)
    assert member_problems("BuilderFlag", SimpleNamespace(FP16=1), real_trt.BuilderFlag) == \
        ["BuilderFlag.FP16 is not a member of tensorrt.BuilderFlag"]
