"""Producer pinning (aot/versions.py): the compiler warns — never fails — when the running torch or
triton is not the pinned one, in Python (ProducerVersionWarning) and in `grace compile`'s output."""
from __future__ import annotations

import re
import tomllib
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import grace.aot  # noqa: E402
from grace.aot import versions  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.tools.models import MLP  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_pins_the_same_versions():
    """One set of pins: the `aot` extra installs what versions.PINNED names."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["aot"]
    pins = dict(re.fullmatch(r"([a-z]+)==(.+)", req).groups() for req in extra)
    assert pins == versions.PINNED


def test_the_message_says_what_runs_what_is_pinned_and_what_to_do():
    msg = versions.producer_warning({"torch": "2.11.0+cu130", "triton": "3.6.0"})
    assert "torch 2.11.0 (pinned: 2.13.0)" in msg and "triton 3.6.0 (pinned" not in msg
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in msg
    both = versions.producer_warning({"torch": "2.13.0", "triton": "3.5.1"})
    assert "triton 3.5.1 (pinned: 3.6.0)" in both and "torch 2.13.0 (pinned" not in both
    assert versions.mismatches({"torch": "2.13.0+cpu", "triton": "3.6.0"}) == []   # local tag ignored
    assert versions.producer_warning({"torch": "2.13.0", "triton": "3.6.0"}) is None


def test_the_pinned_versions_compile_without_a_warning(tmp_path):
    """The pinned versions (tools/setup.sh's venv): no warning at all."""
    if versions.running() != versions.PINNED:
        pytest.skip(f"this environment runs {versions.running()}, not the pinned {versions.PINNED}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", versions.ProducerVersionWarning)
        grace.aot.compile(MLP().eval(), (torch.randn(2, 64),), output=tmp_path / "m.grace")


def test_another_torch_warns_and_still_compiles(tmp_path, monkeypatch, capsys):
    """torch 2.11 (the GPU machine's) is a warning, not an error; the package records it."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.warns(versions.ProducerVersionWarning, match=r"torch 2\.11\.0 \(pinned: 2\.13\.0\)"):
        path = grace.aot.compile(MLP().eval(), (torch.randn(2, 64),), output=tmp_path / "m.grace",
                                 progress=True)
    assert read_package(path).manifest["producer"]["torch"] == "2.11.0"
    err = capsys.readouterr().err
    assert "grace: warning" in err and "torch 2.11.0 (pinned: 2.13.0)" in err


def test_another_triton_warns(monkeypatch):
    monkeypatch.setattr(versions, "running", lambda: {"torch": "2.13.0", "triton": "3.7.0"})
    with pytest.warns(versions.ProducerVersionWarning, match=r"triton 3\.7\.0 \(pinned: 3\.6\.0\)"):
        assert versions.warn_if_unpinned() is not None


def test_grace_compile_prints_one_line_and_no_python_warning(tmp_path, monkeypatch, capsys):
    from grace.tools import cli

    src = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(MLP().eval(), (torch.randn(2, 64),)), src)
    monkeypatch.setattr(versions, "running", lambda: {"torch": "2.11.0", "triton": "3.6.0"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["compile", str(src), "-o", str(tmp_path / "m.grace")]) == 0
    assert not [w for w in caught if issubclass(w.category, versions.ProducerVersionWarning)]
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "pinned: 2.13.0" in ln]
    assert len(lines) == 1 and lines[0].startswith("grace: warning"), err
