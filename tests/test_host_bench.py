"""tools/host_bench.py without a GPU: its inputs are what run() accepts, its stages are run()'s
pieces, and the default mode runs end to end on the fake driver (tests/helpers_handmade.py's bucket
package, real cubins, instead of compiling a BERT).
"""

from __future__ import annotations

import json
import re

import pytest

from grace.runtime import driver
from grace.runtime.arrays import as_record
from grace.runtime.validate import ArrayCheck
from grace.tools import host_bench

pytest.importorskip("cuda.bindings.driver")


@pytest.fixture
def fake(monkeypatch):
    from grace.tools.fuzz import FakeDriver

    f = FakeDriver()
    monkeypatch.setattr(driver, "_cu", f)
    return f


@pytest.fixture(scope="module")
def bucket_package(tmp_path_factory):
    pytest.importorskip("triton")
    try:
        from helpers_handmade import build_bucket_package
    except ImportError:
        from tests.helpers_handmade import build_bucket_package
    return build_bucket_package(tmp_path_factory.mktemp("host_bench") / "buckets.grace", data_output=True)


@pytest.mark.parametrize("kind", ["torch", "cai", "dlpack", "device"])
def test_each_input_kind_is_a_device_array_run_accepts(fake, kind):
    """The torch stand-in goes the way of a CUDA torch tensor (arrays._from_torch) and passes the
    checks' shortcut, as the other kinds pass their own ways in."""
    from grace.formats.view import TensorSpec

    spec = TensorSpec("input_ids", "int64", (1, "seq"), 0)
    obj = host_bench.fake_input(kind, spec, host_bench._input_shape(spec, 129))
    rec = as_record(obj, "input 'input_ids'", 1)
    if rec.device is None:
        rec.device = driver.pointer_device(rec.ptr)
    assert rec.shape == (1, 129) and rec.dtype == "int64" and rec.device == 0
    ArrayCheck("input 'input_ids'", "int64", 0).check(rec)
    if kind == "torch":
        assert rec.strides is None  # torch says contiguous: its strides are not read


def test_the_default_mode_on_the_fake_driver(fake, bucket_package, tmp_path, capsys):
    out = tmp_path / "host.json"
    assert host_bench.main(["--package", str(bucket_package), "--seq", "20", "--repeats", "3",
                            "--number", "20", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "fake" and res["graph"] == "n=32" and res["input"] == "torch"
    assert set(res["stages_us"]) == {*host_bench.STAGES, "loop"}
    for fig in [res["run_us"], res["run_alternating_us"], *res["stages_us"].values()]:
        assert 0 < fig["min"] <= fig["median"] and (fig["repeats"], fig["number"]) == (3, 20)
    text = capsys.readouterr().out
    assert "run(), same input buffer" in text and "setparams" in text and "sum" in text


def test_the_stages_are_what_run_does(fake, bucket_package):
    """Each stage function runs alone without disturbing the session: a run() after them launches
    the same words, and the words stage builds what run() hands to the graph."""
    from grace.runtime import load

    pkg = load(bucket_package)
    try:
        sess = pkg.session()
        x = host_bench.fake_input("torch", pkg.inputs[0], (20, 8))
        sess.run(x)
        fns = host_bench.stage_functions(sess, (x,))
        assert set(fns) == set(host_bench.STAGES)
        results = {name: fn() for name, fn in fns.items()}
        graph = sess._graphs[sess._package.graph_names.index("n=32")]
        assert results["words"] == graph._words   # the words the last run() set
        assert list(results["outputs"]) == [s.name for s in pkg.outputs]
        sess.run(x)
        sess.close()
    finally:
        pkg.close()


def test_help_names_both_modes(capsys):
    with pytest.raises(SystemExit) as e:
        host_bench.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--gpu" in text and "--json" in text and "fake" in text


def test_the_gpu_report_names_every_figure():
    """--gpu's figures (made up here: the mode needs a GPU) each get their line, the first run()
    after a sync among them, and the stages their sum."""
    def fig(median):
        return {"median": median, "min": median - 1, "repeats": 100, "number": 20}
    res = {"mode": "gpu", "device": "NVIDIA H100 80GB HBM3", "model": "BERT", "input": "torch", "seq": 129,
           "graph": "seq=256", "run_us": fig(7.5), "run_alternating_us": fig(9.5), "run_first_us": fig(15.25),
           "run_sync_us": fig(1880.0), "eager_sync_us": fig(7000.0), "eager_host_us": fig(900.0),
           "stages_us": {**{name: fig(1.0 + i) for i, name in enumerate(host_bench.STAGES)}, "loop": fig(0.03)}}
    text = host_bench.report(res)
    assert "NVIDIA H100" in text
    assert "run(), the first after a sync" in text and "15.25 µs/call" in text
    for label in ("same input buffer", "alternating", "run() + sync()", "eager torch + sync", "host only"):
        assert label in text
    assert re.search(r"^ +sum +28\.00 ", text, re.M)  # 1 + 2 + ... + 7
