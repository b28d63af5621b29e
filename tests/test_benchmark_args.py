"""tools/benchmark.py without a GPU: argument parsing, the mixed-length stream, the package summary,
the summary tables and the torch.compile build counters (on the CPU, backend="eager")."""

import pytest

from grace.tools import benchmark as B

# ---- the mixed-length stream -------------------------------------------------------------------


def test_mixed_lengths_is_fixed_by_the_seed():
    a = B.mixed_lengths(200, 1, 512, seed=0)
    assert a == B.mixed_lengths(200, 1, 512, seed=0)
    assert a != B.mixed_lengths(200, 1, 512, seed=1)
    assert len(a) == 200 and all(isinstance(n, int) and 1 <= n <= 512 for n in a)
    # a spread of lengths over the whole range, not a handful of values
    assert len(set(a)) > 100 and min(a) < 64 and max(a) > 448


def test_mixed_lengths_bounds_are_inclusive():
    assert set(B.mixed_lengths(500, 3, 4, seed=0)) == {3, 4}
    assert B.mixed_lengths(5, 7, 7) == [7] * 5


@pytest.mark.parametrize("n, lo, hi", [(0, 1, 512), (10, 0, 512), (10, 9, 8)])
def test_mixed_lengths_rejects_bad_ranges(n, lo, hi):
    with pytest.raises(ValueError):
        B.mixed_lengths(n, lo, hi)


# ---- arguments ---------------------------------------------------------------------------------


def test_default_models_are_the_static_ones():
    args = B.parse_args([])
    assert args.static == ["vit_s", "gpt2_6l"] and args.dynamic == []
    assert args.buckets == {} and args.lengths == (100, 129, 300) and args.stream_calls == 200
    assert args.precision == "tf32x3"


def test_dynamic_workload_and_its_options():
    args = B.parse_args(["--models", "vit_s,bert_base_dyn", "--buckets", "seq=64,128,512",
                         "--dyn-lengths", "1,512", "--stream-calls", "50", "--seed", "3",
                         "--fp32-matmul", "tf32,tf32x3"])
    assert args.static == ["vit_s"] and args.dynamic == ["bert_base_dyn"]
    assert args.buckets == {"seq": [64, 128, 512]}
    assert args.lengths == (1, 512) and args.stream_calls == 50 and args.seed == 3
    assert args.precision == "tf32"


def test_backend_ab_is_off_by_default_and_a_flag():
    assert B.parse_args([]).backend_ab is False and B.parse_args([]).pdl_ab is False
    args = B.parse_args(["--backend-ab", "--models", "gpt2_6l,bert_base_dyn", "--buckets", "seq=64,512",
                         "--fp32-matmul", "tf32,ieee"])
    assert args.backend_ab and args.static == ["gpt2_6l"] and args.dynamic == ["bert_base_dyn"]
    # the grace contender's precision; the dynamic workload's seq buckets under Dynamo's dim name
    assert B.backend_options(args.precision, args.buckets) == {
        "fp32_matmul": "tf32", "buckets": {"input_ids.1": [64, 512]}}
    assert B.backend_options("tf32x3") == {"fp32_matmul": "tf32x3"}
    assert "--backend-ab" in B.build_parser().format_help()


def test_backend_options_are_valid_backend_options():
    """What the benchmark passes is what the backend accepts (its own option parser)."""
    pytest.importorskip("torch")
    from grace.aot.backend import BackendOptions

    opts = BackendOptions.parse(B.backend_options("ieee", {"seq": [16, 512]}))
    assert opts.fp32_matmul == "ieee" and opts.buckets == (("input_ids.1", (16, 512)),)


@pytest.mark.parametrize("argv, words", [
    (["--models", "bert_large"], ["unknown workload bert_large", "bert_base_dyn"]),
    (["--models", ","], ["--models"]),
    (["--buckets", "seq=32,16"], ["strictly increasing"]),
    (["--buckets", "seq=0"], ["positive"]),
    (["--dyn-lengths", "0,100"], ["[1, 512]"]),
    (["--dyn-lengths", "100,abc"], ["integers"]),
    (["--dyn-lengths", "513"], ["[1, 512]"]),
    (["--stream-calls", "0"], ["--stream-calls"]),
])
def test_bad_arguments_are_usage_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        B.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


# ---- package summary and tables ----------------------------------------------------------------


def test_grace_graphs_reads_the_manifest():
    manifest = {"graphs": [
        {"name": "seq=64", "bucket": {"seq": 64}, "stats": {"kernels": 90}, "arena": 1 << 20,
         "nodes": []},
        {"name": "seq=512", "bucket": {"seq": 512}, "stats": {"kernels": 92}, "arena": 8 << 20},
    ]}
    assert B._grace_graphs(manifest) == [
        {"name": "seq=64", "bucket": {"seq": 64}, "kernels": 90, "arena": 1 << 20},
        {"name": "seq=512", "bucket": {"seq": 512}, "kernels": 92, "arena": 8 << 20},
    ]


def _dynamic_result():
    counts = {"dynamo_graphs": 3, "frames_compiled": 3, "cudagraph_warmups": 160,
              "cudagraph_recordings": 35, "inductor": {}}
    warm = dict(counts, dynamo_graphs=0, cudagraph_warmups=0, cudagraph_recordings=125)
    return {
        "model": "bert_base_dyn", "kind": "dynamic",
        "config": {"stream_calls": 200, "stream_distinct_lengths": 165, "range": [1, 512]},
        "ms": {"100": {"eager": 4.5, "torch.compile": 2.25, "reduce-overhead": 1.5, "grace": 1.75},
               "129": {"eager": 4.75, "grace": 1.875},
               "300": {}},
        "stream": {
            "eager": {"cold_ms_per_call": 6.0, "warm_ms_per_call": 5.0},
            "reduce-overhead": {"cold_ms_per_call": 300.0, "warm_ms_per_call": 40.0,
                                "built_cold": counts, "built_warm": warm},
            "grace": {"cold_ms_per_call": 2.5, "warm_ms_per_call": 2.0,
                      "instantiations": {"seq=128": 1, "seq=512": 1}},
        },
        "grace": {"graph_count": 2, "compile_s": 12.5, "run_host_us_129": 17.25,
                  "rel_err_vs_eager_tf32": {"100": 7.5e-4},
                  "graphs": [{"name": "seq=128", "bucket": {"seq": 128}, "kernels": 90,
                              "arena": 3 << 20},
                             {"name": "seq=512", "bucket": {"seq": 512}, "kernels": 92,
                              "arena": None}]},
        "errors": {"torch.compile": "RuntimeError: boom"},
    }


def test_dynamic_table_shows_every_figure_and_dashes_for_missing_ones():
    text = B.format_dynamic_table(_dynamic_result())
    lines = text.splitlines()
    row = {ln.split()[0] + ln.split()[1]: ln.split()[2:] for ln in lines
           if ln.startswith(("seq ", "stream "))}
    assert row["seq100"] == ["4.500", "2.250", "1.500", "1.750"]
    assert row["seq129"] == ["4.750", "-", "-", "1.875"]
    assert row["seq300"] == ["-", "-", "-", "-"]
    assert row["streamcold"] == ["6.000", "-", "300.000", "2.500"]
    assert row["streamwarm"] == ["5.000", "-", "40.000", "2.000"]
    assert "200 calls, 165 distinct lengths in [1, 512]" in text
    assert ("reduce-overhead: built by the cold pass: 3 dynamo graphs, 35 CUDA-graph recordings; "
            "by the warm pass: 0 / 125") in text
    assert "grace: 2 graphs, 2 instantiated by the stream, run() host 17.2 us at seq 129" in text
    assert "100:7.5e-04" in text
    assert "seq=128:90k/3.0MiB, seq=512:92k/-" in text
    assert lines[-1] == "error torch.compile: RuntimeError: boom"


def test_dynamic_table_when_grace_failed():
    res = _dynamic_result()
    res["grace"], res["errors"] = {}, {"grace": "LoweringError: no"}
    del res["stream"]["grace"]
    text = B.format_dynamic_table(res)
    assert "grace graphs" not in text and "error grace: LoweringError: no" in text


def test_static_table_has_a_backend_column():
    notes = {"grace_kernels": 51, "grace_run_host_us": 19.0, "grace_rel_err_vs_eager_tf32": 7.5e-4}
    results = [{"model": "vit_s", "ms": {"eager": 4.0, "torch.compile": 2.0, "reduce-overhead": 0.8,
                                         "grace": 0.5, "grace-backend": 0.55},
                "notes": notes, "ratio_grace_over_reduce_overhead": 0.625},
               {"model": "gpt2_6l", "ms": {"eager": 3.0, "torch.compile": 1.4, "reduce-overhead": 0.4,
                                           "grace": 0.42},
                "notes": notes, "ratio_grace_over_reduce_overhead": 1.05}]
    head, row, other = B.format_static_table(results).splitlines()
    assert head.split()[4:6] == ["grace", "grace-backend"]
    assert row.split()[4:6] == ["0.500", "0.550"]
    assert other.split()[4:6] == ["0.420", "nan"]   # not timed for that model


def test_dynamic_table_has_a_backend_column():
    res = _dynamic_result()
    res["stream"]["grace-backend"] = {"cold_ms_per_call": 900.0, "warm_ms_per_call": 1.9,
                                      "built_cold": {"dynamo_graphs": 3, "cudagraph_recordings": 0},
                                      "built_warm": {"dynamo_graphs": 0, "cudagraph_recordings": 0}}
    res["ms"]["100"]["grace-backend"] = 1.8
    lines = B.format_dynamic_table(res).splitlines()
    assert lines[1].split()[-1] == "grace-backend"
    row = {ln.split()[0] + ln.split()[1]: ln.split()[2:] for ln in lines
           if ln.startswith(("seq ", "stream "))}
    assert row["seq100"][-1] == "1.800" and row["seq129"][-1] == "-"
    assert row["streamcold"][-1] == "900.000" and row["streamwarm"][-1] == "1.900"
    assert any(ln.startswith("grace-backend: built by the cold pass: 3 dynamo graphs") for ln in lines)


def test_static_table_keeps_its_columns():
    notes = {"grace_kernels": 51, "grace_run_host_us": 19.0, "grace_rel_err_vs_eager_tf32": 7.5e-4}
    results = [{"model": "gpt2_6l", "ms": {"eager": 3.0, "torch.compile": 1.4, "reduce-overhead": 0.4,
                                           "grace": 0.42, "grace[tf32]": 0.28},
                "notes": notes, "ratio_grace_over_reduce_overhead": 1.05}]
    head, row = B.format_static_table(results).splitlines()
    assert head.split() == ["model", "eager", "compile", "red-ovh", "grace", "grace[tf32]", "g/ro",
                            "kernels", "host", "us", "rel", "err"]
    assert row.split() == ["gpt2_6l", "3.000", "1.400", "0.400", "0.420", "0.280", "1.05", "51",
                           "19.0", "7.5e-04"]


# ---- torch.compile counters --------------------------------------------------------------------


def test_torch_counts_sees_compiles_and_restores_the_patch():
    torch = pytest.importorskip("torch")
    from torch._inductor import cudagraph_trees

    originals = (cudagraph_trees.CUDAGraphTreeManager.record_function,
                 cudagraph_trees.CUDAGraphTreeManager.run_eager)
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    try:
        with B._TorchCounts() as first:
            f(torch.ones(3))
            f(torch.ones(3))
        with B._TorchCounts() as again:
            f(torch.ones(3))
            f(torch.ones(5))  # a new static shape: one recompile
    finally:
        torch._dynamo.reset()
    assert first.result["dynamo_graphs"] == 1 and again.result["dynamo_graphs"] == 1
    assert first.result["cudagraph_recordings"] == 0 and first.result["cudagraph_warmups"] == 0
    assert (cudagraph_trees.CUDAGraphTreeManager.record_function,
            cudagraph_trees.CUDAGraphTreeManager.run_eager) == originals


# ---- tools/bench_decode.py's table ---------------------------------------------------------------


def test_decode_table_without_reduce_overhead_says_so_and_prints_no_ratio():
    from grace.tools import bench_decode as D
    res = {"shape": "8b", "max_seq": 2048, "pos": 1000, "bytes_per_token": 16e9, "steps": 64,
           "ms_per_token": {"eager": 16.6, "grace": 4.6}, "hbm_fraction": {"eager": 0.2, "grace": 0.7},
           "errors": {}, "skipped": ["reduce-overhead: --no-reduce-overhead"]}
    table = D.format_table(res)
    assert "skipped reduce-overhead: --no-reduce-overhead" in table
    grace_row = next(line for line in table.splitlines() if line.startswith("grace"))
    assert grace_row.split()[1] == "4.600" and grace_row.split()[-1] == "-"
    res["ms_per_token"]["reduce-overhead"] = 4.6 * 2
    res["hbm_fraction"]["reduce-overhead"] = 0.35
    grace_row = next(line for line in D.format_table(res).splitlines() if line.startswith("grace"))
    assert grace_row.split()[-1] == "0.50"


def test_decode_table_shows_each_timeline_and_a_failed_profile_is_an_error(tmp_path):
    from grace.tools import bench_decode as D
    res = {"shape": "1b", "max_seq": 2048, "pos": 1000, "bytes_per_token": 2.5e9, "steps": 64,
           "ms_per_token": {"grace run()": 0.97}, "hbm_fraction": {"grace run()": 0.6},
           "errors": {}, "timelines": {"split": {"table": "GPU span per call 900.0 us\nmm ...",
                                                 "rows": []}}}
    table = D.format_table(res)
    assert "timeline split (as built" in table and "  GPU span per call 900.0 us" in table
    with pytest.raises(RuntimeError, match="profile_kernels exited"):
        D._timeline(tmp_path / "missing.grace", 1000, tmp_path, "x")


def test_decode_table_says_how_far_grace_drifted_when_timed_again(monkeypatch):
    """A generate() A/B of the thirty-fifth session was drift (grace's own package 0.981 first,
    0.974 last, the variant 0.977 between): the table prints the re-timing beside the variants,
    and --no-again reaches run() as again=False."""
    from grace.tools import bench_decode as D
    res = {"shape": "1b", "max_seq": 2048, "pos": 1000, "bytes_per_token": 2.5e9, "steps": 64,
           "ms_per_token": {"grace generate()": 0.981, "grace generate() again": 0.974},
           "hbm_fraction": {"grace generate()": 0.6, "grace generate() again": 0.6},
           "errors": {}, "drift": {"generate()": 0.974 / 0.981 - 1}}
    table = D.format_table(res)
    assert "grace's own package timed again last: generate() -0.7%" in table
    del res["drift"]
    assert "timed again" not in D.format_table(res)
    seen = {}

    def fake_run(*args):
        seen["again"] = args[-1]
        return res

    monkeypatch.setattr(D, "run", fake_run)
    D.main(["--variant", "x:codegen.GEMV_TILE=2048", "--no-again"])
    assert seen["again"] is False


def test_a_dynamic_variant_is_compiled_with_its_constants_and_timed_as_its_own(monkeypatch,
                                                                               tmp_path):
    """bench_dynamic's variants (it ignored --variant before): compiled with the constants set
    (and restored after), recorded with their settings and how many graph nodes they changed,
    then timed under grace[NAME]."""
    from grace.aot import fuse_norm
    from grace.tools.variants import parse_variant

    seen = {}

    def fake_compile(model, cfg, path, precision=None):
        seen["fold"] = fuse_norm.FOLD_SPLIT_K_INTO_NORM
        return {"compile_s": 1.0}

    def fake_run(res, path, model, inputs, cfg, key="grace"):
        seen["key"], seen["path"] = key, path

    class Model:
        def cpu(self):
            return self

        def cuda(self):
            return self

    monkeypatch.setattr(B, "_compile_grace_dyn", fake_compile)
    monkeypatch.setattr(B, "_run_grace", fake_run)
    monkeypatch.setattr("grace.formats.read_package",
                        lambda p: type("P", (), {"manifest": str(p)}))
    # the manifests stand in as their paths: the variant's differs from grace's package
    monkeypatch.setattr(B, "nodes_changed", lambda a, b: 0 if a == b else 3)
    variant = parse_variant("nofold:fuse_norm.FOLD_SPLIT_K_INTO_NORM=False")
    res = {"model": "bert_base_dyn"}
    B._run_grace_variant(res, "grace[nofold]", variant, Model(), None, None,
                                 tmp_path / "v.grace", tmp_path / "g.grace")
    assert seen == {"fold": False, "key": "grace[nofold]", "path": tmp_path / "v.grace"}
    assert fuse_norm.FOLD_SPLIT_K_INTO_NORM   # restored
    assert res["grace[nofold]"]["nodes_changed"] == 3
    assert "FOLD_SPLIT_K_INTO_NORM=False" in res["grace[nofold]"]["settings"]


def test_generate_per_token_pairs_loops_and_takes_the_median():
    """bench_decode's generate() figure: loops of steps + 1 and 2 * steps + 1 tokens timed back
    to back, the median pair; one pair with a slow prefill in its short loop (which the old
    one-token difference would have credited to the loop) does not move it. A cache too short
    for both loops falls back to a one-token short call."""
    from grace.tools import bench_decode as D
    calls, slow = [], iter([0.0, 0.0, 0.016, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])

    def timed(n):   # 10 ms prefill (16 ms more once), 0.8 ms a token
        calls.append(n)
        return 0.010 + (next(slow) if n == 65 else 0.0) + n * 0.0008

    ms, prefill, pairs = D.generate_ms_per_token(timed, 64, 1000, 2048, 5)
    assert calls == [65, 129] * 5
    assert ms == pytest.approx(0.8) and prefill == pytest.approx(10.8)
    assert min(pairs) == pytest.approx(0.8 - 16 / 64)
    calls.clear()
    slow = iter([0.0] * 10)
    D.generate_ms_per_token(timed, 64, 2000, 2048, 2)
    assert calls == [1, 65, 1, 65]


def test_wave_cap_ab_help_names_its_modes(capsys):
    """tools/wave_cap_ab.py runs on a GPU machine only; here its command line."""
    from grace.tools import wave_cap_ab
    with pytest.raises(SystemExit) as e:
        wave_cap_ab.main(["--help"])
    assert e.value.code == 0
    assert "one-wave cap" in capsys.readouterr().out
    assert wave_cap_ab.MODES[:3] == ("cap", "nocap", "cap>2/SM")
    with pytest.raises(SystemExit) as e:
        wave_cap_ab.main(["--modes", "cap,bogus"])
    assert e.value.code == 2 and "unknown ['bogus']" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        wave_cap_ab.main(["--variant", "no-colon"])
    assert e.value.code == 2 and "expected NAME:module.CONSTANT=VALUE" in capsys.readouterr().err
    for twice in (["--variant", "a:codegen.GEMV_TILE=2048"] * 2,
                  ["--variant", "default:codegen.GEMV_TILE=2048"]):
        with pytest.raises(SystemExit) as e:
            wave_cap_ab.main(twice)
        assert e.value.code == 2 and "a name of its own" in capsys.readouterr().err
    # a variant is always timed beside the defaults' package, one variant or several
    from grace.tools.variants import parse_variant
    one, two = (parse_variant(f"{n}:codegen.GEMV_TILE=2048") for n in ("one", "two"))
    assert wave_cap_ab.packages([]) == [None]
    assert wave_cap_ab.packages([one]) == [None, one]
    assert wave_cap_ab.packages([one, two]) == [None, one, two]


def test_wave_cap_rules_leave_the_chosen_nodes_uncapped():
    """wave_cap_ab's modes on the programmatic nodes of a decode-like graph (132 SMs, the
    H200's shared memory): the runtime's cap, none, the cap only past two programs per SM, all
    but the attention and its combine, all but grids of at most 32, all but the combine, only
    grids of at most two (four) programs per SM, all but the attention."""
    from grace.runtime import occupancy
    from grace.runtime.graph import NodePlan
    from grace.tools.wave_cap_ab import cap_rules

    limits = occupancy.SharedLimits(132, 233472, 1024, 232448)
    grids = [(264, 1, 1), (1, 8, 32), (1, 32, 1), (1024, 2, 1), (512, 1, 1), (1, 1, 1)]
    families = ["matmul", "attention", "attn_combine", "matmul", "matmul", "reduction"]
    plans = [NodePlan(i, f"node {i}", i, g, 128, 1024, (), (i - 1,), (i - 1,))
             for i, g in enumerate(grids)]
    rules = cap_rules(occupancy.cap_programmatic, families)
    capped = [p.shared for p in occupancy.cap_programmatic(plans, limits)]
    assert capped[:3] == [76928, 76928, 115840] and capped[3] > 1024 and capped[4] > 1024
    assert capped[5] == 115840   # a one-program mean: one a multiprocessor
    shared = {mode: [p.shared for p in rule(plans, limits)] for mode, rule in rules.items()}
    assert shared["cap"] == capped
    assert shared["nocap"] == [1024] * 6
    assert shared["cap>2/SM"] == [1024, 1024, 1024, capped[3], capped[4], 1024]
    assert shared["cap-attn"] == [capped[0], 1024, 1024, capped[3], capped[4], capped[5]]
    assert shared["cap-small"] == [capped[0], capped[1], 1024, capped[3], capped[4], 1024]
    assert shared["cap-combine"] == [capped[0], capped[1], 1024, capped[3], capped[4],
                                     capped[5]]
    assert shared["cap<=2/SM"] == capped[:3] + [1024, 1024, capped[5]]
    assert shared["cap<=4/SM"] == capped[:3] + [1024, capped[4], capped[5]]
    assert shared["cap-attn1"] == [capped[0], 1024] + capped[2:]
