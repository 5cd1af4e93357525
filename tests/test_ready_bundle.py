"""A bundle ready to schedule out of the box: `dspark export` puts in the drafter's shipped
calibration when it was fitted on the same drafter-target pair, and a quick SPS profile of this
machine; a calibration of another pair, or a table from another CPU, is caught on load."""
from __future__ import annotations

import json
import shutil
import warnings

import pytest

from dspark.runtime import Engine
from dspark.runtime.calibration import CALIBRATION_FILE, Calibration
from dspark.runtime.cpu import cpu_signature
from dspark.runtime.errors import BundleError
from dspark.runtime.manifest import Manifest
from dspark.runtime.throughput import SpsTable


@pytest.fixture(scope="module")
def exported(tiny_bundle, tmp_path_factory):
    """The tiny target with a copy of its drafter that ships the calibration fitted on the tiny
    bundle (fp32), exported twice with the CLI's defaults (quick profile on): at fp32, the pair
    the calibration was fitted on, and at int4, another precision."""
    from factories import TINY_CALIBRATION

    from dspark.export.bundle import export_bundle

    root = tmp_path_factory.mktemp("ready")
    shutil.copytree(tiny_bundle.path, root / "fitted")
    TINY_CALIBRATION.save(root / "fitted", {"synthetic": True})
    shutil.copytree(tiny_bundle.drafter_dir, root / "drafter")
    shutil.copyfile(root / "fitted" / CALIBRATION_FILE, root / "drafter" / CALIBRATION_FILE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for precision in ("fp32", "int4"):
            export_bundle(root / precision, tiny_bundle.target_dir, root / "drafter", progress=False,
                          precision=precision)
    return root, [str(w.message) for w in caught]


def test_export_ships_the_calibration_of_the_same_pair(exported):
    root, caught = exported
    assert (root / "fp32" / CALIBRATION_FILE).read_bytes() == (root / "drafter" / CALIBRATION_FILE).read_bytes()
    assert Manifest.load(root / "fp32").source_hashes == Manifest.load(root / "fitted").source_hashes
    assert not (root / "int4" / CALIBRATION_FILE).exists()
    assert [w for w in caught if "fitted on another precision" in w and f"dspark calibrate --bundle {root / 'int4'}" in w]


def test_export_profiles_this_machine(exported):
    root, _ = exported
    for precision in ("fp32", "int4"):
        d = json.loads((root / precision / "sps.json").read_text())
        assert d["meta"]["cpu"] == cpu_signature() and d["meta"]["precision"] == precision
        assert len(d["grid"]) == 8  # profile.QUICK: 8 slots
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the default scheduler plans from the start
        engine = Engine.load(root / "fp32", max_seq=128, threads=1)
        assert engine.scheduler("auto").name == "cost"
        assert engine.generate("hello", max_new_tokens=16).token_ids == \
            engine.generate("hello", max_new_tokens=16, scheduler="none").token_ids


def test_a_calibration_of_another_pair_is_refused(exported, tmp_path):
    root, _ = exported
    bundle = tmp_path / "b"
    shutil.copytree(root / "int4", bundle)
    shutil.copyfile(root / "fp32" / CALIBRATION_FILE, bundle / CALIBRATION_FILE)
    with pytest.raises(BundleError, match=rf"fitted on another target precision.*dspark calibrate --bundle {bundle}"):
        Engine.load(bundle, max_seq=64)
    d = json.loads((root / "fp32" / CALIBRATION_FILE).read_text())
    d["for"]["drafter"] = "0" * 64  # another drafter
    (bundle / CALIBRATION_FILE).write_text(json.dumps({**d, "for": {**d["for"], "precision": "int4"}}))
    with pytest.raises(BundleError, match=r"fitted on another drafter"):
        Engine.load(bundle, max_seq=64)
    (bundle / CALIBRATION_FILE).write_text(json.dumps({"format": 1, "temperatures": [1.0] * 4}))
    with pytest.raises(BundleError, match=r"format is 1, expected 2.*dspark calibrate"):
        Engine.load(bundle, max_seq=64)


def test_an_sps_table_of_another_cpu_warns(exported, tmp_path):
    root, _ = exported
    bundle = tmp_path / "b"
    shutil.copytree(root / "fp32", bundle)
    d = json.loads((bundle / "sps.json").read_text())
    d["meta"]["cpu"] = {**d["meta"]["cpu"], "flags": ["avx2", "fma"], "cores": 64}
    (bundle / "sps.json").write_text(json.dumps(d))
    with pytest.warns(UserWarning, match=r"measured on another CPU.*cores.*re-run `dspark profile --bundle"):
        table = SpsTable.load(bundle, "fp32")
    assert table is not None  # still used: a warning, not a refusal


def test_calibrate_binds_its_file_to_the_pair(exported, tmp_path):
    root, _ = exported
    bundle = tmp_path / "b"
    shutil.copytree(root / "int4", bundle)
    Calibration((1.0, 1.0, 1.0, 1.0)).save(bundle, {"synthetic": True})
    pair = json.loads((bundle / CALIBRATION_FILE).read_text())["for"]
    m = Manifest.load(bundle)
    assert pair == {"drafter": m.source_hashes["drafter"], "target": m.source_hashes["target"], "precision": "int4"}
    assert Engine.load(bundle, max_seq=64).calibration.temperatures == (1.0,) * 4
