"""The compiler's stages made visible: the named pipeline, GRACE_DUMP (every stage's state and every
kernel source on disk), GRACE_OVERRIDE (a kernel's source swapped by name, recorded in the
manifest) and `grace inspect --source NAME`. The build is replaced by stand-in binaries: what is
tested is which sources reach it and what the package records, not Triton."""
from __future__ import annotations

import hashlib
import io
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from grace.aot import build, codegen, compiler, dump  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.tools import cli, models  # noqa: E402
from grace.tools.inspect import KernelSourceError, describe, kernel_source, render  # noqa: E402

STAGES = ["export", "symbols", "lower", "fuse", "memplan", "codegen", "table", "override",
          "build", "package"]


def _stand_in(requests):
    """A build replaced by stand-in cubins that records every request it is given."""
    def fake(reqs, options):
        requests.extend(reqs)
        return [build.Binary(b"\x7fELF" + hashlib.sha256(r.source.encode()).digest(), 0, 0, 0,
                             r.num_warps) for r in reqs]
    return fake


@pytest.fixture
def built(monkeypatch):
    """Stand-in cubins; `built` collects every build request the compile made."""
    requests = []
    monkeypatch.setattr(compiler, "_build_with_progress", _stand_in(requests))
    return requests


def _compile(tmp_path, name="m.grace"):
    """The MLP with a dynamic batch, buckets 4 and 8: two graphs, six kernels."""
    batch = torch.export.Dim("batch", min=1, max=8)
    return compiler.compile(models.MLP().eval(), (torch.randn(3, 64),), output=tmp_path / name,
                            dynamic_shapes={"x": {0: batch}}, buckets={"batch": [4, 8]})


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """One compile with GRACE_DUMP (shared by the tests that only read it): (package path, dump
    folder, the build requests)."""
    root = tmp_path_factory.mktemp("dumped")
    out = root / "dump"
    (out / "graph-stale").mkdir(parents=True)
    (out / dump.MARKER).write_text("an older dump")   # replaced whole, not mixed in
    requests = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiler, "_build_with_progress", _stand_in(requests))
        mp.setenv("GRACE_DUMP", str(out))
        torch.manual_seed(0)
        path = _compile(root)
    return path, out, requests


def test_the_pipeline_is_a_named_list_of_stages():
    assert [s.name for s in compiler.PIPELINE] == STAGES
    per_bucket = [s.name for s in compiler.PIPELINE if s.per_bucket]
    assert per_bucket == ["lower", "fuse", "memplan", "codegen"]
    verified = {s.name for s in compiler.PIPELINE if s.verify}
    assert verified == {"lower", "fuse", "memplan", "codegen"}
    assert set(dump.FORMATS) == set(STAGES)   # every stage has a dump format


def test_grace_dump_writes_every_stage_and_every_kernel(dumped):
    path, out, built = dumped
    pkg = read_package(path)
    m = pkg.manifest

    index = (out / "index.txt").read_text()
    assert not (out / "graph-stale").exists()
    for rel in ("01-export.txt", "02-symbols.txt", "07-table.txt", "09-build.txt", "10-package.json"):
        assert rel in index and (out / rel).exists()
    assert not (out / "08-override.txt").exists()   # nothing was overridden
    for graph in ("batch=4", "batch=8"):
        for rel in ("03-lower.txt", "04-fuse.txt", "05-memplan.txt", "06-codegen.txt"):
            assert (out / f"graph-{graph}" / rel).exists(), (graph, rel)
    # the stages' states say what each stage did
    assert "aten.addmm" in (out / "01-export.txt").read_text() or \
        "aten.mm" in (out / "01-export.txt").read_text()
    assert "batch (input" in (out / "02-symbols.txt").read_text()
    lowered = (out / "graph-batch=4" / "03-lower.txt").read_text()
    assert "x input float32[4*, 64]" in lowered and "fc1.weight weight float32[128, 64]" in lowered
    fused = (out / "graph-batch=4" / "04-fuse.txt").read_text()
    # bias + GELU fused into the first GEMM; a dynamic output is stored by a kernel of its own
    assert "kernels (3):" in fused and "#0 matmul" in fused and "gelu" in fused
    assert "#2 pointwise" in fused and "out output float32[4*, 32]" in fused
    assert "arena placements" in (out / "graph-batch=4" / "05-memplan.txt").read_text()
    assert "after kernels ['#0']" in (out / "graph-batch=8" / "06-codegen.txt").read_text()
    assert json.loads((out / "10-package.json").read_text())["kernels"] == \
        json.loads(json.dumps(m["kernels"]))
    # every kernel of the package, named by its kernel name, byte for byte
    names = {k["name"] for k in m["kernels"]}
    assert {p.stem for p in (out / "kernels").glob("*.py")} == names
    for k in m["kernels"]:
        assert (out / "kernels" / f"{k['name']}.py").read_bytes() == bytes(pkg.section(k["source"]))
    assert len(built) == len(names)


def test_a_failing_stage_leaves_the_dump_of_the_stages_before_it(tmp_path, monkeypatch, built):
    def refuse(kernel, *a, **k):
        raise ValueError("cannot evaluate this size")
    monkeypatch.setattr(codegen, "generate", refuse)
    monkeypatch.setenv("GRACE_DUMP", str(tmp_path / "dump"))
    with pytest.raises(Exception, match="cannot evaluate this size"):
        _compile(tmp_path)
    error = (tmp_path / "dump" / "ERROR.txt").read_text()
    assert error.startswith("stage codegen, bucket batch=4 failed:")
    assert (tmp_path / "dump" / "graph-batch=4" / "05-memplan.txt").exists()
    assert not (tmp_path / "dump" / "graph-batch=4" / "06-codegen.txt").exists()


def test_grace_override_swaps_a_source_by_name_and_says_so(tmp_path, monkeypatch, built, dumped):
    clean_path, dumped_dir, _ = dumped
    clean = read_package(clean_path).manifest
    assert "overrides" not in clean["producer"]
    name = next(k["name"] for k in clean["kernels"] if k["family"] == "matmul")
    edited = (dumped_dir / "kernels" / f"{name}.py").read_text() + "# hand-tuned\n"
    (tmp_path / "over").mkdir()
    (tmp_path / "over" / f"{name}.py").write_text(edited)
    monkeypatch.setenv("GRACE_OVERRIDE", str(tmp_path / "over"))
    torch.manual_seed(0)   # the same weights as the clean package
    with pytest.warns(dump.OverrideWarning, match=rf"sources of 1 kernel\(s\) were replaced \({name}\)"):
        pkg = read_package(_compile(tmp_path, "over.grace"))
    m = pkg.manifest
    assert m["producer"]["overrides"] == [name]
    kernel = next(k for k in m["kernels"] if k["name"] == name)
    assert bytes(pkg.section(kernel["source"])).decode() == edited
    assert kernel["source_sha256"] == hashlib.sha256(edited.encode()).hexdigest()
    assert [r.source for r in built if r.name == name] == [edited]   # what was built
    # the other kernels are codegen's, and inspect flags the package
    assert [k["source_sha256"] for k in m["kernels"] if k["name"] != name] == \
        [k["source_sha256"] for k in clean["kernels"] if k["name"] != name]
    text = io.StringIO()
    from rich.console import Console
    render(describe(pkg), Console(file=text, width=200))
    assert f"NOT A CLEAN BUILD: the sources of 1 kernel(s) came from GRACE_OVERRIDE: {name}" in \
        text.getvalue()
    # a file that names no kernel is refused, not ignored
    (tmp_path / "over" / "matmul_0000.py").write_text("")
    with pytest.raises(dump.OverrideError, match=r"matmul_0000.py name\(s\) no kernel of this "
                                                  r"program; its kernels are: .*table_writer"):
        _compile(tmp_path, "bad.grace")


def test_inspect_source_prints_a_kernel(dumped, capsys):
    path = dumped[0]
    pkg = read_package(path)
    name = pkg.manifest["kernels"][1]["name"]
    source = bytes(pkg.section(pkg.manifest["kernels"][1]["source"])).decode()
    assert kernel_source(pkg, name) == source
    assert cli.main(["inspect", str(path), "--source", name]) == 0
    assert capsys.readouterr().out == source
    with pytest.raises(KernelSourceError, match=rf"no kernel 'matmul' in this package \(did you "
                                                rf"mean .*\); its kernels are: table_writer, {name}"):
        kernel_source(pkg, "matmul")
    assert cli.main(["inspect", str(path), "--source", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("grace inspect: error: KernelSourceError: ") and "table_writer" in err


def test_inspect_source_escapes_terminal_controls():
    """A package is input from anyone: its text never reaches the terminal as escape codes."""
    class Pkg:
        class view:
            kernels = [type("K", (), {"name": "k", "source": "src/k.py"})()]

        @staticmethod
        def section(name):
            return memoryview(b"x = 1  \x1b[2J\x07\n\tok\n")

    assert kernel_source(Pkg, "k") == "x = 1  \\x1b[2J\\x07\n\tok\n"
