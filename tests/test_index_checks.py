"""Index checks (format 3.3, SPEC §5.4): an out-of-range gather index never reads outside its table
and is reported at the next synchronising point, naming the input.

Two layers:
  * the runtime's side against test_runtime_nogpu's FakeDriver (fast): the session zeroes the
    error word when it is made, reads it at .numpy() / sync() / a data-dependent shape, raises
    IndexOutOfRangeError (an IndexError) naming the input, zeroes it and stays usable;
  * compiled models (slow) through the CPU reference executor: an embedding and a gather /
    index / index_select model; good ids (negative ones wrap) match eager, an id past either end
    raises naming `input_ids` while the kernels read a clamped row (no NaN from the poisoned
    arena), the next good call works, the manifest lists the checks, the race checker accepts
    concurrent stores of codes and still catches a real race on the table; `grace run
    --interpret` reports the error on one line.
"""
from __future__ import annotations

import copy
import ctypes
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import grace.runtime as rt
from grace.runtime.errors import IndexOutOfRangeError, InvalidPackageError
from test_runtime_nogpu import fake, manifest, write  # noqa: F401 (fake: a fixture)

ERROR_WORD = 88   # the fake package's table: slots [0, 40) and [48, 88), no symbols


def checked_manifest() -> dict:
    m = manifest()
    m["table"]["errors"] = {"offset": ERROR_WORD}
    m["index_checks"] = [{"code": 1, "input": "x", "op": "aten.embedding",
                          "where": "model.py:12: return self.emb(x)", "size": 128},
                         {"code": 2, "input": None, "op": "aten.gather", "where": "", "size": 7}]
    return m


def _word(sess) -> int:
    return ctypes.c_int64.from_address(sess._table + ERROR_WORD).value


def _store_code(sess, code: int) -> None:
    """What a kernel does when it meets an out-of-range index."""
    ctypes.c_int64.from_address(sess._table + ERROR_WORD).value = code


def test_session_zeroes_the_word_and_reports_at_numpy(fake, tmp_path):
    pkg = rt.load(write(tmp_path / "m.grace", checked_manifest()))
    sess = pkg.session(poison=True)   # the table is poisoned with 0xFF, then the word is zeroed
    assert _word(sess) == 0
    x = np.ones((4, 32), np.float32)
    out = sess.run(x)["out"]
    out.numpy()                       # nothing stored: no error
    _store_code(sess, 1)
    with pytest.raises(IndexOutOfRangeError) as info:
        out.numpy()
    msg = str(info.value)
    assert msg.startswith("input 'x': an index is outside [-128, 128) in aten.embedding "
                          "(model.py:12: return self.emb(x))")
    assert isinstance(info.value, IndexError) and isinstance(info.value, rt.GraceRuntimeError)
    assert (info.value.input, info.value.op, info.value.code) == ("x", "aten.embedding", 1)
    assert _word(sess) == 0           # reported once, then cleared
    out.numpy()
    sess.run(x)["out"].numpy()        # the session stays usable
    pkg.close()


def test_sync_reports_and_unknown_codes_are_package_errors(fake, tmp_path):
    pkg = rt.load(write(tmp_path / "m.grace", checked_manifest()))
    sess = pkg.session()
    sess.run(np.ones((4, 32), np.float32))
    sess.sync()
    _store_code(sess, 2)
    with pytest.raises(IndexError, match=r"an index computed in the model: an index is outside "
                                         r"\[-7, 7\) in aten\.gather; the outputs"):
        sess.sync()
    sess.sync()
    _store_code(sess, 5)
    with pytest.raises(InvalidPackageError, match=r"error word holds 5, which no index check"):
        sess.sync()
    pkg.close()


def test_packages_without_checks_read_no_word(fake, tmp_path):
    pkg = rt.load(write(tmp_path / "m.grace"))
    assert pkg.index_checks is None
    sess = pkg.session()
    sess.run(np.ones((4, 32), np.float32))
    ctypes.c_int64.from_address(sess._table + ERROR_WORD).value = 1   # not an error word here
    sess.sync()
    pkg.close()


def test_dynamic_table_sizes_are_named_or_evaluated():
    from grace.formats.view import IndexCheck
    from grace.runtime.checks import IndexChecks

    checks = IndexChecks(0, [IndexCheck(1, "ids", "aten.index", "", ["+", "seq", 1]),
                             IndexCheck(2, "ids", "aten.index", "", "seq")])
    assert "outside [-(seq + 1), seq + 1)" in str(checks.error(1))
    assert "outside [-seq, seq)" in str(checks.error(2))
    assert "outside [-6, 6)" in str(checks.error(1, {"seq": 5}))


# ---------------------------------------------------------------------------- compiled models

RUNNER = textwrap.dedent('''
    """Run CASES (in order, one session) through the interpreter: outputs, or the error and the
    raw output buffers the kernels wrote (the table keeps pointing at them)."""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    from grace.tools.interpret import InterpretSession

    package, cases_path, result_path = sys.argv[1:4]
    with np.load(cases_path) as data:
        cases = {}
        for key in data.files:
            case, name = key.split("/", 1)
            cases.setdefault(case, {})[name] = data[key]
    sess = InterpretSession(package)
    result = {}
    for case in sorted(cases):
        try:
            out = sess.run(cases[case])
        except Exception as exc:
            result[f"{case}/error"] = np.array(f"{type(exc).__name__}: {exc}")
            for name, buf in getattr(sess, "_buffers", {}).items():
                if name not in cases[case]:
                    result[f"{case}/raw/{name}"] = buf.numpy().copy()
            continue
        for name, value in out.items():
            result[f"{case}/{name}"] = value
    np.savez(result_path, **result)
''')


def run_cases(path, cases: list[dict], tmp_path) -> list[dict]:
    """cases[i] -> {"error": str} or {output: array}, plus {"raw/<output>": array} on error."""
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    packed = {f"c{i:02d}/{name}": v for i, case in enumerate(cases) for name, v in case.items()}
    np.savez(tmp_path / "cases.npz", **packed)
    proc = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "cases.npz"),
                           str(tmp_path / "result.npz")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [{} for _ in cases]
    with np.load(tmp_path / "result.npz") as data:
        for key in data.files:
            case, name = key.split("/", 1)
            value = data[key]
            results[int(case[1:])][name] = str(value) if name == "error" else value
    return results


def _models():
    import torch

    class Emb(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(128, 16)
            self.proj = torch.nn.Linear(16, 8)

        def forward(self, input_ids):
            return self.proj(self.emb(input_ids))   # the line the error names

    class Gathers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(10, 4))

        def forward(self, x, input_ids, pos):
            a = self.table[input_ids].sum(-1)                        # aten.index
            b = torch.index_select(x, 0, input_ids).sum(-1)          # aten.index_select
            c = torch.gather(x, 1, pos).sum(-1)                      # aten.gather
            return a + b + c

    return Emb, Gathers


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from torch.export import Dim

    from grace.aot import compile as grace_compile

    tmp = tmp_path_factory.mktemp("checks")
    Emb, Gathers = _models()
    torch.manual_seed(0)
    emb, gathers = Emb().eval(), Gathers().eval()
    out = {"emb": emb, "gathers": gathers}
    out["emb_path"] = grace_compile(emb, (torch.randint(0, 128, (2, 7)),), output=tmp / "emb.grace",
                                    progress=False, fp32_matmul="ieee")
    seq = Dim("seq", min=1, max=16)
    out["emb_dyn_path"] = grace_compile(emb, (torch.randint(0, 128, (2, 7)),),
                                        output=tmp / "emb_dyn.grace", progress=False,
                                        fp32_matmul="ieee", dynamic_shapes={"input_ids": {1: seq}},
                                        buckets={"seq": [8, 16]})
    example = (torch.randn(6, 5), torch.randint(0, 6, (4,)), torch.randint(0, 5, (4, 3)))
    out["gathers_path"] = grace_compile(gathers, example, output=tmp / "gathers.grace",
                                        progress=False, fp32_matmul="ieee")
    return out


def _eager(model, *args):
    import torch
    with torch.no_grad():
        return model(*[torch.from_numpy(a) for a in args]).numpy()


@pytest.mark.slow
def test_embedding_reports_out_of_range_ids_and_recovers(built, tmp_path):
    good = np.array([[1, 2, 3, -1, -128, 127, 0], [5, 6, 7, 8, 9, 10, 11]], np.int64)  # negatives wrap
    past, below = good.copy(), good.copy()
    past[1, 3] = 128
    below[0, 0] = -129
    huge = good.copy()
    huge[0, 5] = 2**40
    results = run_cases(built["emb_path"], [{"input_ids": good}, {"input_ids": past},
                                            {"input_ids": below}, {"input_ids": huge},
                                            {"input_ids": good}], tmp_path)
    ref = _eager(built["emb"], good % 128)   # torch's embedding refuses negative ids; grace wraps them
    for r in (results[0], results[4]):   # the flag was cleared: the last good call works
        assert "error" not in r, r.get("error")
        np.testing.assert_allclose(r["out"], ref, rtol=1e-5, atol=1e-6)
    for r, bad in zip(results[1:4], (past, below, huge)):
        assert r["error"].startswith("IndexOutOfRangeError: input 'input_ids': an index is outside "
                                     "[-128, 128) in aten.embedding (test_index_checks.py:"), r["error"]
        assert "return self.proj(self.emb(input_ids))" in r["error"]
        raw = r["raw/out"]
        assert not np.isnan(raw).any(), "a kernel read memory outside the table (NaN poison)"
        clamped = np.where((bad < -128) | (bad >= 128), 0, bad) % 128   # clamped: row 0
        np.testing.assert_allclose(raw, _eager(built["emb"], clamped), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_embedding_with_dynamic_length_checks_only_real_positions(built, tmp_path):
    """Padded positions of a bucket (seq 5 in the bucket of 8) read masked loads, never the
    poisoned arena: no false report; a bad id at a real position is still reported."""
    good = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], np.int64)
    bad = good.copy()
    bad[1, 4] = 999
    results = run_cases(built["emb_dyn_path"], [{"input_ids": good}, {"input_ids": bad},
                                                {"input_ids": good[:, :3]}], tmp_path)
    assert "error" not in results[0] and "error" not in results[2]
    np.testing.assert_allclose(results[0]["out"], _eager(built["emb"], good), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[2]["out"], _eager(built["emb"], good[:, :3]), rtol=1e-5,
                               atol=1e-6)
    assert "input 'input_ids': an index is outside [-128, 128)" in results[1]["error"]


@pytest.mark.slow
def test_gather_index_and_index_select_report_their_input(built, tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    ids = np.array([0, 5, -1, -6], np.int64)
    pos = np.array([[0, 4, -5], [1, 2, 3], [-1, 0, 0], [4, 4, 4]], np.int64)
    bad_ids = ids.copy()
    bad_ids[1] = 6          # inside the table of 10 rows (aten.index) but past x's 6 rows
    bad_pos = pos.copy()
    bad_pos[2, 1] = -6
    results = run_cases(built["gathers_path"], [
        {"x": x, "input_ids": ids, "pos": pos}, {"x": x, "input_ids": bad_ids, "pos": pos},
        {"x": x, "input_ids": ids, "pos": bad_pos}, {"x": x, "input_ids": ids, "pos": pos}], tmp_path)
    table = built["gathers"].table.detach().numpy()
    # by hand: torch's index_select and gather refuse the negative indices that grace wraps
    ref = table[ids].sum(-1) + x[ids].sum(-1) + np.take_along_axis(x[:4], pos % 5, 1).sum(-1)
    for r in (results[0], results[3]):
        assert "error" not in r, r.get("error")
        np.testing.assert_allclose(r["out"], ref, rtol=1e-5, atol=1e-5)
    assert ("IndexOutOfRangeError: input 'input_ids': an index is outside [-6, 6) in "
            "aten.index_select") in results[1]["error"]
    assert ("IndexOutOfRangeError: input 'pos': an index is outside [-5, 5) in "
            "aten.gather") in results[2]["error"]
    for r in results[1:3]:
        assert not np.isnan(r["raw/out"]).any()


@pytest.mark.slow
def test_manifest_lists_the_checks(built):
    from grace.formats import read_package
    from grace.tools.inspect import describe

    m = read_package(built["emb_path"]).manifest
    assert m["format_version"] >= [3, 3]   # index checks since 3.3
    (check,) = m["index_checks"]
    assert check["code"] >= 1 and check["input"] == "input_ids" and check["op"] == "aten.embedding"
    assert check["size"] == 128 and check["where"].startswith("test_index_checks.py:")
    errors = m["table"]["errors"]["offset"]
    ext = m["table"]["extents"]
    assert errors % 8 == 0 and errors >= ext["offset"] + 8 * ext["count"]
    assert errors + 8 <= m["table"]["nbytes"]
    users = [n for g in m["graphs"] for n in g["nodes"]
             if {"region": "table", "offset": errors, "nbytes": 8, "dtype": "int64"} in n["args"]]
    assert users and all(0 in n["deps"] for n in users)
    assert describe(read_package(built["emb_path"]))["index_checks"]["count"] == 1

    g = read_package(built["gathers_path"]).manifest
    ops = sorted((c["op"], c["input"], c["size"]) for c in g["index_checks"])
    assert ops == [("aten.gather", "pos", 5), ("aten.index", "input_ids", 10),
                   ("aten.index_select", "input_ids", 6)]
    assert len({c["code"] for c in g["index_checks"]}) == 3

    dyn = read_package(built["emb_dyn_path"]).manifest
    assert [c["size"] for c in dyn["index_checks"]] == [128] and len(dyn["graphs"]) == 2


@pytest.mark.slow
def test_race_checker_lets_codes_commute_but_catches_a_missing_edge(built):
    from grace.formats import read_package
    from grace.formats.races import check_races

    m = read_package(built["gathers_path"]).manifest
    assert check_races(m) == []
    errors = m["table"]["errors"]["offset"]
    word = {"region": "table", "offset": errors, "nbytes": 8, "dtype": "int64"}
    graph = m["graphs"][0]
    users = [j for j, n in enumerate(graph["nodes"]) if word in n["args"]]
    assert users

    def plus_node(writes: list, deps: list) -> dict:
        """m with one more node, unordered with the gathers: a kernel that only touches the word."""
        out = copy.deepcopy(m)
        out["kernels"].append({"name": "word_user", "family": "test", "writes": writes,
                               "params": [{"name": "err", "type": "*i64"}]})
        out["graphs"][0]["nodes"].append({"kernel": len(out["kernels"]) - 1, "grid": [1, 1, 1],
                                          "deps": deps, "args": [dict(word)], "label": "word_user"})
        return out

    assert check_races(plus_node([0], [0])) == []   # two unordered stores of codes: no race
    # a store that the table writer (whose range covers the whole table) may race with
    problems = check_races(plus_node([0], []))
    assert any("node 0 (table_writer)" in p and "word_user" in p for p in problems), problems
    # a kernel that reads the word, unordered with the gathers' stores: a race
    problems = check_races(plus_node([], [0]))
    assert any("word_user" in p and "touch table" in p for p in problems), problems


@pytest.mark.slow
def test_grace_run_interpret_reports_one_line(built, tmp_path):
    ids = np.array([[1, 2, 3, 4, 5, 6, 200], [0, 0, 0, 0, 0, 0, 0]], np.int64)
    f = tmp_path / "ids.npy"
    np.save(f, ids)
    proc = subprocess.run([sys.executable, "-m", "grace.tools.cli", "run", str(built["emb_path"]),
                           "--interpret", "--input", f"input_ids={f}"], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("grace run: error: IndexOutOfRangeError: input 'input_ids': "
                               "an index is outside [-128, 128) in aten.embedding")
    proc = subprocess.run([sys.executable, "-m", "grace.tools.cli", "inspect", str(built["emb_path"]),
                           "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["index_checks"]["count"] == 1
