"""The packages of tests/gpu/test_decode_kernels_gpu.py's GEMV forms, compiled without a GPU: each
holds the form it is named for and no other, and passes the race and pre-wait checks. The GPU
test times nothing and checks values; this one keeps its preconditions true in CI (see
tests/gemv_forms.py for the time they were not). That the pairing is on by default is
tests/test_fuse_rows.py's test_both_gemv_forms_are_paired_by_default."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gemv_forms import FORMS, MlpStep, check_form_sources, set_form  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.formats.races import check_pre_wait, check_races  # noqa: E402


@pytest.mark.parametrize("form", FORMS)
def test_each_gemv_form_package_holds_its_form(tmp_path, form, monkeypatch):
    set_form(monkeypatch, form)
    torch.manual_seed(0)
    model = MlpStep().eval().to(torch.bfloat16)
    path = grace_compile(model, (torch.randn(1, 1, 4096).to(torch.bfloat16),),
                         output=tmp_path / "m.grace", progress=False)
    pkg = read_package(path)
    check_form_sources(pkg, form)
    assert check_races(pkg.manifest) == [] and check_pre_wait(pkg) == []

