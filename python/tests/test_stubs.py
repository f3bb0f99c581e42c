"""The shipped stub (pagedkv/_pagedkv.pyi) is what nanobind's stubgen renders for the built module today."""
import importlib.util
import os
import pathlib
import sys

import pytest

import pagedkv

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_stub_matches_module():
    if importlib.util.find_spec("nanobind") is None:
        pytest.skip("nanobind not installed here (stubgen unavailable)")
    sys.path.insert(0, str(ROOT))
    from generate_stubs import render

    pkg_dir = pathlib.Path(pagedkv.__file__).resolve().parents[1]
    committed = (ROOT / "pagedkv" / "_pagedkv.pyi").read_text()
    assert render(str(pkg_dir)) == committed, "regenerate: python python/generate_stubs.py " + str(pkg_dir)


def test_stub_and_marker_ship_with_the_package():
    d = pathlib.Path(pagedkv.__file__).parent
    assert (d / "_pagedkv.pyi").is_file() and (d / "py.typed").is_file()
    assert os.path.getsize(d / "_pagedkv.pyi") > 1000
