"""The `grace` command line, run as a subprocess (python -m grace.tools.cli)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

try:
    from helpers_handmade import build_handmade_package, make_weights, reference
except ImportError:  # tests/ imported as a package
    from tests.helpers_handmade import build_handmade_package, make_weights, reference

SUBCOMMANDS = ["compile", "check", "inspect", "run", "generate", "bench", "verify"]


def grace(*args, cwd=None, timeout=300, env=None, python_args=()):
    env = {**os.environ, **(env or {})}
    env.pop("TRITON_INTERPRET", None)
    env["COLUMNS"] = "200"  # rich wraps tables to the terminal width
    return subprocess.run(
        [sys.executable, *python_args, "-m", "grace.tools.cli", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout,
    )


def _one_line_error(r, code=1):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert err and "\n" not in err, r.stderr
    assert "Traceback" not in r.stderr
    return err


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    pytest.importorskip("triton")
    return build_handmade_package(tmp_path_factory.mktemp("cli") / "handmade.grace")


# ---- help ---------------------------------------------------------------------------------------


def test_help():
    r = grace("--help")
    assert r.returncode == 0, r.stderr
    for sub in SUBCOMMANDS:
        assert sub in r.stdout
    assert "examples:" in r.stdout


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_help(sub):
    r = grace(sub, "--help")
    assert r.returncode == 0, r.stderr
    assert f"grace {sub}" in r.stdout
    assert "examples:" in r.stdout


def test_no_command_prints_help():
    r = grace()
    assert r.returncode != 0
    assert "usage: grace" in r.stdout


# ---- inspect / verify -----------------------------------------------------------------------------


def test_inspect_human(pkg):
    r = grace("inspect", pkg)
    assert r.returncode == 0, r.stderr
    for word in ("handmade", "sm_90", "table_writer", "k_scale", "k_add", "arena", "weights", "main"):
        assert word in r.stdout, word


def test_inspect_json(pkg):
    r = grace("inspect", pkg, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("path", "file_nbytes", "format_version", "model", "producer", "archs", "inputs", "outputs",
                "table", "memory", "kernels", "graphs", "sections"):
        assert key in d, key
    assert d["model"]["name"] == "handmade"
    assert d["format_version"][0] == 3
    assert d["file_nbytes"] == os.path.getsize(pkg)
    assert set(d["producer"]) >= {"grace", "torch", "triton"}
    assert d["inputs"] == [{"name": "x", "dtype": "float32", "shape": [4, 8], "slot": 0}]
    assert d["outputs"][0]["name"] == "out"
    assert d["table"]["words"] == 10
    assert [s["first_word"] for s in d["table"]["slots"]] == [0, 5]
    regions = d["memory"]["regions"]
    assert {k: regions[k] for k in ("weights", "arena", "table")} == {"weights": 288, "arena": 256, "table": 96}
    assert regions.get("state", 0) == 0
    assert d["memory"]["weights"]["count"] == 2
    assert d["memory"]["arena_buffers"]["largest"][0]["name"] == "t"
    names = [k["name"] for k in d["kernels"]]
    assert names == ["table_writer", "k_scale", "k_add"]
    k_add = d["kernels"][2]
    assert k_add["grids"] == [[4, 1, 1]] and k_add["nodes"] == 1 and k_add["archs"] == ["sm_90"]
    for key in ("family", "num_warps", "num_stages", "shared", "source_sha256"):
        assert key in k_add
    g = d["graphs"][0]
    assert g["name"] == "main" and g["nodes"] == 3
    assert g["families"] == {"pointwise": 2, "table_writer": 1}
    assert g["stats"]["kernels"] == 3
    assert {s["name"] for s in d["sections"]} >= {"weights", "src/k_add.py", "cubin/k_add.sm_90"}


def test_verify_ok(pkg):
    r = grace("verify", pkg)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK")


def test_verify_corrupted(pkg, tmp_path):
    from grace.formats import read_package

    info = {name: (off, n) for name, off, n, _ in read_package(pkg).section_info}
    off, n = info["weights"]
    data = bytearray(pkg.read_bytes())
    data[off + n // 2] ^= 0xFF
    bad = tmp_path / "bad.grace"
    bad.write_bytes(bytes(data))
    err = _one_line_error(grace("verify", bad))
    assert "weights" in err
    # inspect reads with verification too
    _one_line_error(grace("inspect", bad))


def test_verify_not_a_package(tmp_path):
    junk = tmp_path / "junk.grace"
    junk.write_bytes(b"hello, this is not a package" * 10)
    _one_line_error(grace("verify", junk))


def test_verify_missing_file(tmp_path):
    err = _one_line_error(grace("verify", tmp_path / "nope.grace"))
    assert "no such file" in err


# ---- run ------------------------------------------------------------------------------------------


def test_run_interpret(pkg, tmp_path):
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out.npz"
    r = grace("run", pkg, "--input", f"x={tmp_path / 'x.npy'}", "--interpret", "--output", out)
    assert r.returncode == 0, r.stderr
    assert "out" in r.stdout and "float32" in r.stdout and "[4, 8]" in r.stdout
    with np.load(out) as z:
        assert list(z.keys()) == ["out"]
        np.testing.assert_allclose(z["out"], reference(x, make_weights()), rtol=1e-6, atol=1e-6)


def test_run_missing_input_lists_inputs(pkg):
    err = _one_line_error(grace("run", pkg, "--interpret"))
    assert "x (float32[4, 8])" in err


def test_run_unknown_input(pkg, tmp_path):
    np.save(tmp_path / "y.npy", np.zeros((4, 8), np.float32))
    err = _one_line_error(grace("run", pkg, "--input", f"y={tmp_path / 'y.npy'}", "--interpret"))
    assert "'y'" in err and "x (float32[4, 8])" in err


def test_run_wrong_dtype(pkg, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 8), np.float64))
    err = _one_line_error(grace("run", pkg, "--input", f"x={tmp_path / 'x.npy'}", "--interpret"))
    assert "'x'" in err and "float64" in err


def test_run_without_gpu_exits_2(pkg, tmp_path):
    try:
        from cuda.bindings import driver

        ok = driver.cuInit(0)[0] == driver.CUresult.CUDA_SUCCESS
    except Exception:
        ok = False
    if ok:
        pytest.skip("a CUDA driver is present: this test is for GPU-less machines")
    np.save(tmp_path / "x.npy", np.zeros((4, 8), np.float32))
    err = _one_line_error(grace("run", pkg, "--input", f"x={tmp_path / 'x.npy'}"), code=2)
    assert "--interpret" in err


# ---- compile --------------------------------------------------------------------------------------


def test_compile_missing_file(tmp_path):
    err = _one_line_error(grace("compile", tmp_path / "nope.pt2", "-o", tmp_path / "m.grace"))
    assert "no such file" in err


def test_compile_not_an_export(tmp_path):
    pytest.importorskip("torch")
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip file")
    err = _one_line_error(grace("compile", junk, "-o", tmp_path / "m.grace"))
    assert "torch.export" in err
    assert not (tmp_path / "m.grace").exists()


def test_compile_bad_arch(tmp_path):
    f = tmp_path / "m.pt2"
    f.write_bytes(b"")
    err = _one_line_error(grace("compile", f, "-o", tmp_path / "m.grace", "--arch", "hopper"))
    assert "--arch" in err


def test_compile_inspect_run_an_exported_model(tmp_path):
    """The main job through the CLI: torch.export.save → grace compile → inspect --json → run."""
    torch = pytest.importorskip("torch")
    from grace.tools.models import MLP

    torch.manual_seed(0)
    model = MLP().eval()
    torch.export.save(torch.export.export(model, (torch.randn(3, 64),)), tmp_path / "mlp.pt2")
    r = grace("compile", tmp_path / "mlp.pt2", "-o", tmp_path / "mlp.grace", "--name", "mlp",
              "--arch", "sm_90,sm_80")
    assert r.returncode == 0, r.stderr
    desc = json.loads(grace("inspect", tmp_path / "mlp.grace", "--json").stdout)
    assert desc["model"]["name"] == "mlp" and desc["archs"] == ["sm_90", "sm_80"]
    # two variants (PDL on sm_90, the default; none on sm_80): each has its two GEMM kernels
    assert [k["family"] for k in desc["kernels"]] == ["table_writer"] + ["matmul"] * 4
    x = np.random.default_rng(1).standard_normal((3, 64), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    r = grace("run", tmp_path / "mlp.grace", "--interpret", "--input", f"x={tmp_path / 'x.npy'}",
              "--output", tmp_path / "out.npz")
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "out.npz")["out"]
    with torch.no_grad():
        ref = model.double()(torch.from_numpy(x).double()).numpy()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5


# ---- compile --buckets ------------------------------------------------------------------------------


@pytest.mark.parametrize("specs, expected", [
    ([], {}),
    (["input_ids.1=16,32,64"], {"input_ids.1": [16, 32, 64]}),
    (["seq=512"], {"seq": [512]}),
    ([" x.0 = 4, 8 ,16"], {"x.0": [4, 8, 16]}),
    (["a.0=1,2", "b.1=3"], {"a.0": [1, 2], "b.1": [3]}),
])
def test_parse_buckets(specs, expected):
    from grace.tools.cli import parse_buckets

    assert parse_buckets(specs) == expected


@pytest.mark.parametrize("specs, words", [
    (["input_ids.1"], ["NAME=B1,B2"]),
    (["=16,32"], ["name", "empty"]),
    (["seq="], ["no sizes"]),
    (["seq=16,,32"], ["not an integer"]),
    (["seq=16,x"], ["'x'", "not an integer"]),
    (["seq=1.5"], ["not an integer"]),
    (["seq=0,16"], ["positive", "0"]),
    (["seq=-16"], ["positive"]),
    (["seq=32,16"], ["strictly increasing", "16 after 32"]),
    (["seq=16,16"], ["strictly increasing"]),
    (["seq=16", "seq=32"], ["'seq'", "twice"]),
])
def test_parse_buckets_errors(specs, words):
    from grace.tools.cli import CliError, parse_buckets

    with pytest.raises(CliError) as e:
        parse_buckets(specs)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--buckets")
    for w in words:
        assert w in msg, (w, msg)


def test_compile_bad_buckets_one_line(tmp_path):
    """Checked before the export file is even read (an empty file suffices)."""
    f = tmp_path / "m.pt2"
    f.write_bytes(b"")
    err = _one_line_error(grace("compile", f, "-o", tmp_path / "m.grace", "--buckets", "seq=64,32"))
    assert "--buckets seq" in err and "strictly increasing" in err
    err = _one_line_error(grace("compile", f, "-o", tmp_path / "m.grace",
                                "--buckets", "seq=16", "--buckets", "seq=32"))
    assert "twice" in err
    assert not (tmp_path / "m.grace").exists()


def test_compile_help_explains_buckets():
    r = grace("compile", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "--buckets NAME=B1,B2,..." in text
    assert "powers of two" in text and "INPUT.DIM" in text


@pytest.fixture
def mlp_pt2(tmp_path):
    torch = pytest.importorskip("torch")
    from grace.tools.models import MLP

    path = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(MLP().eval(), (torch.randn(3, 64),)), path)
    return path


def test_compile_passes_buckets_and_maps_compiler_errors(mlp_pt2, tmp_path, monkeypatch, capsys):
    """--buckets reaches aot.compile as {name: [bounds]}; a compiler ValueError (LoweringError for
    an unknown symbol) becomes one line on stderr, exit 1 (in-process, the compiler stubbed)."""
    import grace.aot
    from grace.aot.lower import LoweringError
    from grace.tools import cli

    seen = {}

    def fake_compile(program, *a, **kw):
        seen.update(kw)
        raise LoweringError("unknown bucket symbol 'nope'; the program's symbols are: x.0\nmore")

    monkeypatch.setattr(grace.aot, "compile", fake_compile)
    code = cli.main(["compile", str(mlp_pt2), "-o", str(tmp_path / "m.grace"),
                     "--buckets", "nope=4,8", "--buckets", "x.0=2,3"])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert seen["buckets"] == {"nope": [4, 8], "x.0": [2, 3]}
    assert "\n" not in err and err.startswith("grace compile: error: LoweringError")
    assert "'nope'" in err


@pytest.fixture
def compile_kwargs(monkeypatch):
    """grace.aot.compile stubbed: the keyword arguments the CLI passes it land in this dict."""
    import grace.aot

    seen = {}

    def fake_compile(program, *a, output, **kw):
        seen.update(kw)
        output.write_bytes(b"")
        return output

    monkeypatch.setattr(grace.aot, "compile", fake_compile)
    return seen


def test_compile_without_buckets_leaves_the_default(mlp_pt2, tmp_path, compile_kwargs):
    """No --buckets: the compiler gets no buckets, so it picks its default (powers of two)."""
    from grace.tools import cli

    assert cli.main(["compile", str(mlp_pt2), "-o", str(tmp_path / "m.grace")]) == 0
    assert compile_kwargs.get("buckets") is None


@pytest.mark.parametrize("flags, passed", [([], None), (["--gemm-tiles"], None),
                                           (["--no-gemm-tiles"], False)])
def test_compile_gemm_tiles_is_on_unless_turned_off(mlp_pt2, tmp_path, compile_kwargs, flags,
                                                    passed):
    """The measured tile table is the compiler's default: the CLI passes gemm_tiles only to turn
    it off (--no-gemm-tiles)."""
    from grace.tools import cli

    assert cli.main(["compile", str(mlp_pt2), "-o", str(tmp_path / "m.grace"), *flags]) == 0
    assert compile_kwargs.get("gemm_tiles") is passed


@pytest.fixture
def dyn_mlp_pt2(tmp_path):
    torch = pytest.importorskip("torch")
    from grace.tools.models import MLP

    path = tmp_path / "dyn.pt2"
    batch = torch.export.Dim("batch", min=2, max=8)
    ep = torch.export.export(MLP().eval(), (torch.randn(3, 64),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(ep, path)
    return path


def test_compile_buckets_end_to_end(dyn_mlp_pt2, tmp_path):
    """With the real compiler: one graph per requested bucket, named by INPUT.DIM."""
    from grace.formats import read_package

    out = tmp_path / "dyn.grace"
    r = grace("compile", dyn_mlp_pt2, "-o", out, "--buckets", "x.0=4,8")
    assert r.returncode == 0, r.stderr
    graphs = read_package(out).manifest["graphs"]
    assert [g["bucket"] for g in graphs] == [{"x.0": 4}, {"x.0": 8}]


def test_compile_unknown_bucket_name_one_line(dyn_mlp_pt2, tmp_path):
    err = _one_line_error(grace("compile", dyn_mlp_pt2, "-o", tmp_path / "dyn.grace",
                                "--buckets", "nope=4,8"))
    assert "nope" in err
    assert not (tmp_path / "dyn.grace").exists()


def test_bench_inputs_follow_the_size_symbols():
    """`grace bench` makes random inputs for packages with shape buckets: symbols at their maximum
    by default, --size NAME=VALUE to pick a bucket; bad names and out-of-range values are one-line
    errors."""
    from grace.tools.cli import CliError, _random_inputs, _symbol_sizes

    manifest = {"symbols": [{"name": "seq", "kind": "input", "min": 1, "max": 512,
                             "sources": [[0, 1]]}],
                "inputs": [{"name": "ids", "dtype": "int64", "shape": [1, "seq"], "slot": 0}]}
    assert _random_inputs(manifest)["ids"].shape == (1, 512)
    sizes = _symbol_sizes(manifest, ["seq=129"])
    assert _random_inputs(manifest, sizes=sizes)["ids"].shape == (1, 129)
    with pytest.raises(CliError, match="size symbols are: seq"):
        _symbol_sizes(manifest, ["len=3"])
    with pytest.raises(CliError, match=r"\[1, 512\]"):
        _symbol_sizes(manifest, ["seq=600"])


# ---- generate -------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [
    ("tokens=idx,positions=input_pos", {"tokens": "idx", "positions": "input_pos"}),
    (" tokens = idx , positions=pos, logits=out ", {"tokens": "idx", "positions": "pos", "logits": "out"}),
    (None, None),
])
def test_parse_generate(spec, expected):
    from grace.tools.cli import parse_generate

    assert parse_generate(spec) == expected


@pytest.mark.parametrize("spec, words", [
    ("idx", "is not KEY=NAME"),
    ("tokens=idx", "missing positions"),
    ("positions=p", "missing tokens"),
    ("tokens=idx,positions=p,vocab=9", "unknown key 'vocab'"),
    ("tokens=a,tokens=b,positions=p", "tokens given twice"),
    ("tokens=,positions=p", "is not KEY=NAME"),
])
def test_parse_generate_errors_name_the_form(spec, words):
    from grace.tools.cli import CliError, parse_generate

    with pytest.raises(CliError, match="expected tokens=INPUT,positions=INPUT") as e:
        parse_generate(spec)
    assert words in str(e.value)


def test_compile_passes_generate(mlp_pt2, tmp_path, monkeypatch):
    """--generate reaches aot.compile as generate={...}; without it the compiler gets none."""
    import grace.aot
    from grace.tools import cli

    seen = []

    def fake_compile(program, *a, output, **kw):
        seen.append(kw)
        output.write_bytes(b"")
        return output

    monkeypatch.setattr(grace.aot, "compile", fake_compile)
    out = str(tmp_path / "m.grace")
    assert cli.main(["compile", str(mlp_pt2), "-o", out, "--generate", "tokens=x,positions=p,logits=y"]) == 0
    assert cli.main(["compile", str(mlp_pt2), "-o", out]) == 0
    assert seen[0]["generate"] == {"tokens": "x", "positions": "p", "logits": "y"}
    assert "generate" not in seen[1]


def test_compile_bad_generate_one_line(tmp_path):
    f = tmp_path / "m.pt2"
    f.write_bytes(b"not a zip")
    err = _one_line_error(grace("compile", f, "-o", tmp_path / "m.grace", "--generate", "tokens=idx"))
    assert "--generate" in err and "missing positions" in err and "tokens=INPUT,positions=INPUT" in err


@pytest.fixture
def lm_pkg(tmp_path):
    """The fake-cubin causal LM of test_runtime_state.py (a generate map; no real kernels)."""
    try:
        from test_runtime_state import write_lm
    except ImportError:
        from tests.test_runtime_state import write_lm
    return write_lm(tmp_path / "lm.grace")


def test_generate_needs_a_generate_package(pkg, tmp_path):
    np.save(tmp_path / "ids.npy", np.array([1, 2]))
    err = _one_line_error(grace("generate", pkg, "--prompt", tmp_path / "ids.npy", "--max-new-tokens", 3))
    assert "not compiled with --generate" in err


def test_generate_argument_errors_are_one_line(lm_pkg, tmp_path):
    np.save(tmp_path / "f.npy", np.array([1.5]))
    err = _one_line_error(grace("generate", lm_pkg, "--prompt", tmp_path / "f.npy", "--max-new-tokens", 3))
    assert "integers" in err
    err = _one_line_error(grace("generate", lm_pkg, "--prompt", tmp_path / "nope.npy", "--max-new-tokens", 3))
    assert "no such file" in err
    err = _one_line_error(grace("generate", lm_pkg, "--prompt", tmp_path / "f.npy", "--max-new-tokens", 0))
    assert "--max-new-tokens must be >= 1" in err


def test_generate_interpret_calls_the_reference_executor(lm_pkg, tmp_path, monkeypatch, capsys):
    """--interpret: grace.tools.interpret.generate_package(pkg, prompt, max_new, eos) (stubbed here:
    the package's cubins are fake), its ids printed and saved."""
    import grace.tools.interpret as interpret
    from grace.tools import cli

    calls = []

    def fake_generate(package, prompt, max_new_tokens, eos_token_id=None, progress=False):
        calls.append((package.manifest["model"]["name"], prompt.tolist(), max_new_tokens, eos_token_id))
        return np.array([5, 6, 2], np.int64)

    monkeypatch.setattr(interpret, "generate_package", fake_generate, raising=False)
    np.save(tmp_path / "ids.npy", np.array([[1, 2, 3]]))
    out = tmp_path / "new.npy"
    assert cli.main(["generate", str(lm_pkg), "--prompt", str(tmp_path / "ids.npy"), "--max-new-tokens", "4",
                     "--eos", "2", "--interpret", "--output", str(out)]) == 0
    assert calls == [("tiny_lm", [[1, 2, 3]], 4, 2)]
    text = capsys.readouterr().out
    assert "5 6 2" in text and "tokens/s" in text and "3-token prompt" in text
    assert np.load(out).tolist() == [5, 6, 2] and np.load(out).dtype == np.int64


def test_generate_without_gpu_exits_2(lm_pkg, tmp_path):
    try:
        from cuda.bindings import driver

        ok = driver.cuInit(0)[0] == driver.CUresult.CUDA_SUCCESS
    except Exception:
        ok = False
    if ok:
        pytest.skip("a CUDA driver is present: this test is for GPU-less machines")
    np.save(tmp_path / "ids.npy", np.array([1, 2]))
    err = _one_line_error(grace("generate", lm_pkg, "--prompt", tmp_path / "ids.npy", "--max-new-tokens", 3),
                          code=2)
    assert "--interpret" in err


# ---- grace check ------------------------------------------------------------------------------------

BAD_MODEL = '''
import torch, torch.nn as nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.ELU()
    def forward(self, x):
        y = self.act(self.fc(x))
        return torch.cosh(y) + torch.tan(x)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.b1, self.b2 = Block(), Block()
    def forward(self, x):
        return torch.log10(self.b2(self.b1(x)).abs())

torch.export.save(torch.export.export(Model().eval(), (torch.randn(4, 16),)), "bad.pt2")
'''


@pytest.fixture(scope="module")
def bad_pt2(tmp_path_factory):
    """A model with four ops grace does not lower (elu inside nn.ELU), written from its own file."""
    pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("check")
    (d / "bad_model.py").write_text(BAD_MODEL)
    subprocess.run([sys.executable, "bad_model.py"], cwd=d, check=True, capture_output=True)
    return d / "bad.pt2"


def test_check_lists_every_unsupported_op_with_the_users_line(bad_pt2):
    import time

    t0 = time.perf_counter()
    r = grace("check", bad_pt2)
    wall = time.perf_counter() - t0
    assert r.returncode == 1, (r.stdout, r.stderr)
    src = bad_pt2.parent / "bad_model.py"
    out = r.stdout
    for op, count, line in (("aten.elu.default", 2, 10), ("aten.cosh.default", 2, 11),
                            ("aten.tan.default", 2, 11), ("aten.log10.default", 1, 18)):
        assert f"{op} ×{count}: no lowering for this op" in out, out
        assert f'at File "{src}", line {line}, in forward' in out, out
    assert "4 ops cannot be lowered" in out
    assert "torch/nn/modules" not in out   # elu: the user's `self.act(...)`, not activation.py
    assert wall < 120, wall   # torch's import and the .pt2 load are most of it (~6 s on 2 cores)


def test_check_json(bad_pt2):
    r = grace("check", bad_pt2, "--json")
    assert r.returncode == 1, r.stderr
    d = json.loads(r.stdout)
    assert d["ok"] is False and d["model"] == "bad"
    ops = {p["op"]: p for p in d["problems"]}
    assert set(ops) == {"aten.elu.default", "aten.cosh.default", "aten.tan.default", "aten.log10.default"}
    assert ops["aten.elu.default"]["count"] == 2 and ops["aten.elu.default"]["nodes"] == ["elu", "elu_1"]
    assert ops["aten.elu.default"]["locations"][0].endswith("y = self.act(self.fc(x))")


def test_check_a_supported_model_exits_0(mlp_pt2):
    r = grace("check", mlp_pt2)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "every op can be lowered" in r.stdout
    d = json.loads(grace("check", mlp_pt2, "--json").stdout)
    assert d["ok"] is True and d["problems"] == [] and d["graphs"] == 1


def test_check_argument_errors_are_one_line(tmp_path):
    err = _one_line_error(grace("check", tmp_path / "nope.pt2"))
    assert "no such file" in err
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip")
    assert "not a torch.export file" in _one_line_error(grace("check", junk))
    assert "strictly increasing" in _one_line_error(grace("check", junk, "--buckets", "s=8,4"))


def test_compile_error_points_at_the_users_line_and_at_check(bad_pt2, tmp_path):
    err = _one_line_error(grace("compile", bad_pt2, "-o", tmp_path / "bad.grace"))
    src = bad_pt2.parent / "bad_model.py"
    assert "cannot lower aten.elu.default" in err
    assert f'used at File "{src}", line 10, in forward: y = self.act(self.fc(x))' in err
    assert f"grace check {bad_pt2}" in err
    assert not (tmp_path / "bad.grace").exists()


# ---- paper cuts -------------------------------------------------------------------------------------


def test_version():
    from importlib.metadata import version

    r = grace("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"grace {version('grace')} (package format ")
    torch = pytest.importorskip("torch")
    assert f"torch {version('torch')}" in r.stdout and torch.__version__ in r.stdout


@pytest.mark.parametrize("where", ["before", "after", "end"])
def test_traceback_anywhere(where, tmp_path):
    missing = tmp_path / "nope.grace"
    argv = {"before": ["--traceback", "inspect", missing], "after": ["inspect", "--traceback", missing],
            "end": ["inspect", missing, "--traceback"]}[where]
    r = grace(*argv)
    assert r.returncode == 1
    assert "Traceback (most recent call last)" in r.stderr and "CliError" in r.stderr
    _one_line_error(grace("inspect", missing))   # without it: one line


def test_packages_are_written_0644_respecting_the_umask(tmp_path):
    pytest.importorskip("triton")
    old = os.umask(0o022)
    try:
        a = build_handmade_package(tmp_path / "a.grace")
        os.umask(0o027)
        b = build_handmade_package(tmp_path / "b.grace")
    finally:
        os.umask(old)
    assert os.stat(a).st_mode & 0o777 == 0o644
    assert os.stat(b).st_mode & 0o777 == 0o640
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


@pytest.mark.parametrize("case", ["existing_dir", "trailing_slash", "parent_is_a_file", "read_only_dir"])
def test_compile_checks_the_output_before_compiling(case, mlp_pt2, tmp_path, monkeypatch, capsys):
    import grace.aot
    from grace.tools import cli

    def never(*a, **kw):
        raise AssertionError("compiled before the output location was checked")

    monkeypatch.setattr(grace.aot, "compile", never)
    if case == "existing_dir":
        out, words = tmp_path, "is a directory; give the package's file name, e.g. -o"
    elif case == "trailing_slash":
        out, words = f"{tmp_path / 'new'}/", "is a directory"
    elif case == "parent_is_a_file":
        (tmp_path / "f.txt").write_text("x")
        out, words = tmp_path / "f.txt" / "m.grace", "is not a directory"
    else:
        if os.geteuid() == 0:
            pytest.skip("root may write in a read-only directory")
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        out, words = ro / "sub" / "m.grace", "permission denied"
    code = cli.main(["compile", str(mlp_pt2), "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and err.startswith("grace compile: error: -o "), err
    assert words in err, err


def test_compile_output_in_new_folders_is_fine(mlp_pt2, tmp_path, monkeypatch):
    """Missing folders are made by the compiler: not an error."""
    import grace.aot
    from grace.tools import cli

    def fake_compile(program, *a, output, **kw):
        output.parent.mkdir(parents=True)
        output.write_bytes(b"")
        return output

    monkeypatch.setattr(grace.aot, "compile", fake_compile)
    assert cli.main(["compile", str(mlp_pt2), "-o", str(tmp_path / "a" / "b" / "m.grace")]) == 0


def test_interpret_removes_its_temp_folder_at_exit(pkg, tmp_path):
    """The kernel sources --interpret writes (a grace-interpret-* folder) go away with the process."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    x = tmp_path / "x.npy"
    np.save(x, np.ones((4, 8), np.float32))
    script = ("import sys, os, numpy as np\n"
              "from grace.formats import read_package\n"
              "import grace.tools.interpret as it\n"
              f"it.run_package(read_package({str(pkg)!r}), {{'x': np.load({str(x)!r})}})\n"
              "print(it._module_dir, os.path.isdir(it._module_dir))\n")
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    folder, existed = r.stdout.split()
    assert existed == "True" and os.path.basename(folder).startswith("grace-interpret-")
    assert os.path.dirname(folder) == str(tmp)
    assert not os.path.exists(folder) and os.listdir(tmp) == []
    r = grace("run", pkg, "--interpret", "--input", f"x={x}", env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp) == []


def test_library_compile_prints_nothing(tmp_path):
    """grace.aot.compile as a library call: nothing on stdout or stderr; progress=True reports."""
    pytest.importorskip("torch")
    script = ("import torch, grace.aot\n"
              "from grace.tools.models import MLP\n"
              "m = MLP().eval()\n"
              "grace.aot.compile(m, (torch.randn(3, 64),), output='quiet.grace')\n"
              "grace.aot.compile(m, (torch.randn(3, 64),), output='loud.grace', progress=True)\n")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    quiet = subprocess.run([sys.executable, "-c", script.rsplit("grace.aot.compile(m", 1)[0]],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "" and quiet.stderr == "", (quiet.stdout, quiet.stderr)
    assert (tmp_path / "quiet.grace").exists()
    loud = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=600)
    assert loud.returncode == 0, loud.stderr
    assert "wrote loud.grace" in " ".join(loud.stderr.split())


_NO_AOT = '''
import sys
class _NoAot:   # a runtime-only install: `pip install grace`, no torch, no triton
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoAot())
from grace.tools.cli import main
sys.exit(main(sys.argv[1:]))
'''


def _runtime_only(*args):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", _NO_AOT, *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_runtime_only_install_names_the_aot_extra(pkg, mlp_pt2, tmp_path):
    np.save(tmp_path / "x.npy", np.ones((4, 8), np.float32))
    runs = [("run", pkg, "--interpret", "--input", f"x={tmp_path / 'x.npy'}"),
            ("compile", mlp_pt2, "-o", tmp_path / "m.grace"),
            ("check", mlp_pt2)]
    for argv in runs:
        err = _one_line_error(_runtime_only(*argv))
        assert "pip install 'grace[aot]'" in err, (argv, err)
        assert "ModuleNotFoundError" not in err or "No module named" in err
    assert "compiler: not installed (pip install 'grace[aot]')" in _runtime_only("--version").stdout


def test_runtime_only_no_gpu_hint_names_the_aot_extra(pkg, tmp_path):
    try:
        from cuda.bindings import driver

        ok = driver.cuInit(0)[0] == driver.CUresult.CUDA_SUCCESS
    except Exception:
        ok = False
    if ok:
        pytest.skip("a CUDA driver is present: this test is for GPU-less machines")
    np.save(tmp_path / "x.npy", np.ones((4, 8), np.float32))
    err = _one_line_error(_runtime_only("run", pkg, "--input", f"x={tmp_path / 'x.npy'}"), code=2)
    assert "--interpret" in err and "pip install 'grace[aot]'" in err
    # with torch and triton installed, the plain hint
    err = _one_line_error(grace("run", pkg, "--input", f"x={tmp_path / 'x.npy'}"), code=2)
    assert "--interpret" in err and "grace[aot]" not in err


def test_internal_errors_keep_their_traceback(monkeypatch, capsys):
    """A plain ValueError (or KeyError, ...) from inside grace is a bug: traceback plus a last line
    saying so; grace's own user errors stay one line; an "internal: ..." LoweringError is a bug."""
    from grace.aot.lower import LoweringError
    from grace.formats import ManifestError
    from grace.tools import cli

    def raising(exc):
        def cmd(args):
            raise exc
        return cmd

    cases = [(ValueError("not enough values to unpack"), True),
             (KeyError("buf3"), True),
             (LoweringError("internal: buckets lowered to different argument tables"), True),
             (LoweringError("cannot lower aten.cosh.default (node 'cosh'), used at x.py:1"), False),
             (ManifestError("manifest: kernels[0]: missing 'name'"), False),
             (FileNotFoundError("x.npy"), False)]
    for exc, internal in cases:
        monkeypatch.setattr(cli, "cmd_verify", raising(exc))
        code = cli.main(["verify", "m.grace"])
        err = capsys.readouterr().err.strip()
        assert code == 1, exc
        if internal:
            assert "Traceback (most recent call last)" in err, err
            last = err.splitlines()[-1]
            assert last.startswith("grace verify: internal error (a bug in grace") and type(exc).__name__ in last
        else:
            assert "\n" not in err and err.startswith("grace verify: error: "), err
            assert "Traceback" not in err
