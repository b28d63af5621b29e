"""aot/fuse_append.py (on by default, as codegen.ATTN_KV_BEFORE_WAIT):
a decode step's KV-cache appends after the attention, which takes this token's key and value from the appends' expressions. Checked through
the CPU reference executor against eager and against the same model compiled without the pass
(which it must match bit for bit: the attention reads the very values the appends store)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot import fuse_append  # noqa: E402
from grace.formats import races, read_package  # noqa: E402
from grace.tools.interpret import InterpretSession  # noqa: E402
from grace.tools.models import CachedLlama  # noqa: E402
from grace.tools.variants import applied, parse_variant  # noqa: E402

# the appends moved after the attention as kernels of their own (APPEND_IN_ATTENTION, on by
# default, stores them in the attention: tested below)
ON = parse_variant("append:fuse_append.APPEND_AFTER_ATTENTION=True,"
                   "fuse_append.APPEND_IN_ATTENTION=False")
OFF = parse_variant("off:fuse_append.APPEND_AFTER_ATTENTION=False,codegen.ATTN_KV_BEFORE_WAIT=False")
MAX_SEQ = 32


def _model(n_heads=4, n_kv_heads=2, max_seq=MAX_SEQ):
    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                        hidden=96, max_seq=max_seq).eval()
    return model


def _compile(model, path, on, max_seq=MAX_SEQ, **options):
    """`on`: True (the appends after the attention, kernels of their own), False (both knobs
    off), or a variant of its own. A long cache gets prompt buckets at an eighth and a half of
    it, so the interpreter's prefills of short and middle prompts run at their own size."""
    t = Dim("seq", min=1, max=max_seq)
    buckets = [1, max_seq // 8, max_seq // 2, max_seq] if max_seq >= 128 else [1, max_seq]
    with applied(ON if on is True else OFF if on is False else on):
        return grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                             output=path, progress=False, fp32_matmul="ieee",
                             dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                             buckets={"seq": buckets}, **options)


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """Compiled once per module: (heads, kv_heads, on) -> (model, path); generate= on all, so
    the same packages serve run() and generate()."""
    folder, made = tmp_path_factory.mktemp("append"), {}

    def get(heads, kv_heads, on):
        key = (heads, kv_heads, on)
        if key not in made:
            model = _model(heads, kv_heads)
            path = _compile(model, folder / f"{heads}-{kv_heads}-{on}.grace", on,
                            generate={"tokens": "idx", "positions": "input_pos"})
            made[key] = model, path
        return made[key]
    return get


def _families(path, graph="seq=1"):
    m = read_package(path).manifest
    g = next(g for g in m["graphs"] if g["name"] == graph)
    return [m["kernels"][n["kernel"]]["family"] for n in g["nodes"] if "kernel" in n]


def _decode(path, idx, prompt=6, steps=3):
    sess = InterpretSession(path)
    out = [sess.run({"idx": idx[:, :prompt].numpy(), "input_pos": np.arange(prompt)})["out"]]
    for p in range(prompt, prompt + steps):
        out.append(sess.run({"idx": idx[:, p:p + 1].numpy(), "input_pos": np.array([p])})["out"])
    return out


def _eager(model, idx, prompt=6, steps=3):
    with torch.no_grad():
        model.reset_cache()
        ref = [model(idx[:, :prompt], torch.arange(prompt)).numpy()]
        for p in range(prompt, prompt + steps):
            ref.append(model(idx[:, p:p + 1], torch.tensor([p])).numpy())
    return ref


def _prompt_graphs(path):
    """Every graph but the decode step's: its nodes' kernels (named by their source's hash) and
    grids."""
    m = read_package(path).manifest
    return {g["name"]: [(m["kernels"][n["kernel"]]["name"], n["grid"]) for n in g["nodes"]]
            for g in m["graphs"] if g["name"] != "seq=1"}


def _same_decodes(on, off, idx, prompts, model=None):
    """Two steps of decode after each prompt length (fewer at the cache's end): `on`'s logits
    equal `off`'s bit for bit and, with `model`, eager's to 1e-5. The passes under test change
    the decode graph only, so `on` runs its own prefill for the first prompt (and must match
    `off`'s logits and caches bit for bit) and starts from a copy of `off`'s caches after the
    others: the prompt is the interpreter's slowest call."""
    assert _prompt_graphs(on) == _prompt_graphs(off)   # what lets the caches be shared
    for n, prompt in enumerate(prompts):
        steps = min(2, idx.shape[1] - prompt)
        a, b = InterpretSession(on), InterpretSession(off)
        want = [b.run({"idx": idx[:, :prompt].numpy(), "input_pos": np.arange(prompt)})["out"]]
        if n == 0:
            got = [a.run({"idx": idx[:, :prompt].numpy(), "input_pos": np.arange(prompt)})["out"]]
            caches = a.read_state()
            for name, cache in b.read_state().items():
                np.testing.assert_array_equal(caches[name], cache)
        else:
            assert [(e.name, e.offset, e.nbytes) for e in a.state_entries] == \
                [(e.name, e.offset, e.nbytes) for e in b.state_entries]
            a.regions["state"].copy_(b.regions["state"])
            got = list(want)
        for p in range(prompt, prompt + steps):
            feed = {"idx": idx[:, p:p + 1].numpy(), "input_pos": np.array([p])}
            got.append(a.run(feed)["out"])
            want.append(b.run(feed)["out"])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        if model is not None:
            for g, r in zip(got, _eager(model, idx, prompt=prompt, steps=steps)):
                err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
                assert err < 1e-5, (prompt, err)



def test_on_by_default(packages):
    """On by default (both knobs, and the appends stored by the attention itself); off, the
    appends stay before the attention."""
    from grace.aot import codegen
    assert fuse_append.APPEND_AFTER_ATTENTION is True and codegen.ATTN_KV_BEFORE_WAIT is True
    assert fuse_append.APPEND_IN_ATTENTION is True
    fams = _families(packages(4, 2, False)[1])
    assert fams[:fams.index("attention")].count("scatter") == 2


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])   # grouped-query and plain
def test_appends_follow_the_attention_and_the_decode_is_unchanged(packages, heads, kv_heads):
    model, on = packages(heads, kv_heads, True)
    off = packages(heads, kv_heads, False)[1]
    fams = _families(on)
    assert fams.count("attention") == 2 and fams.count("scatter") == 4
    # the race proof (grace verify) holds: every append is ordered after the attention reading
    # its cache, and no kernel reads a weight-free buffer before its gdc_wait
    package = read_package(on)
    assert races.check_races(package.manifest) == [] and races.check_pre_wait(package) == []
    for i, f in enumerate(fams):
        if f == "attention":   # each layer: attention, then its two appends, then the combine
            assert fams[i + 1:i + 3] == ["scatter", "scatter"], fams
    # off the path: no node waits for an append (the memory plan gives no later buffer the bytes
    # the appends read, so there is no write-after-read edge either; ir.Kernel.off_path)
    m = package.manifest
    nodes = next(g for g in m["graphs"] if g["name"] == "seq=1")["nodes"]
    appends = {j for j, n in enumerate(nodes) if m["kernels"][n["kernel"]]["family"] == "scatter"}
    assert len(appends) == 4 and not any(appends & set(n["deps"]) for n in nodes)
    # the prefill graph (seq=32: 32 positions per append) keeps its order
    prefill = _families(on, "seq=32")
    assert prefill[:prefill.index("attention")].count("scatter") == 2
    idx = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    got, want = _decode(on, idx), _decode(off, idx)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)   # the same values, in the same order
    for g, r in zip(got, _eager(model, idx)):
        err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
        assert err < 1e-5, err


def test_a_position_at_the_end_of_the_cache(packages):
    """The last slots of the cache: the appended key is the last key of the last split."""
    on, off = packages(4, 2, True)[1], packages(4, 2, False)[1]
    idx = torch.randint(0, 96, (1, MAX_SEQ), generator=torch.Generator().manual_seed(2))
    got = _decode(on, idx, prompt=MAX_SEQ - 2, steps=2)
    want = _decode(off, idx, prompt=MAX_SEQ - 2, steps=2)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_generate_with_the_appends_moved(packages):
    """generate(): the decode loop's body is the seq=1 graph; its tokens match eager greedy."""
    from grace.tools.interpret import generate_package

    model, path = packages(4, 2, True)
    prompt = torch.randint(0, 96, (5,), generator=torch.Generator().manual_seed(3))
    assert generate_package(path, prompt.numpy(), 6).tolist() == model.greedy(prompt, 6)


def test_packed_grouped_heads(tmp_path):
    """A cache long enough to split the keys packs a key/value head's query heads into one
    program (codegen.ATTN_PACK_GQA): that program takes the appended key and value of its one
    key/value head. Bit for bit the package without the pass, at the cache's start, middle and
    end (the appended key in the first, a middle and the last split), and eager's values."""
    model = _model(8, 2, max_seq=256)
    on = _compile(model, tmp_path / "on.grace", True, max_seq=256)
    off = _compile(model, tmp_path / "off.grace", False, max_seq=256)
    package = read_package(on)
    assert races.check_races(package.manifest) == [] and races.check_pre_wait(package) == []
    fams = _families(on)
    decode = [bytes(package.section(k["source"])).decode()
              for k in package.manifest["kernels"] if k["family"] == "attention"
              and "new_pos" in bytes(package.section(k["source"])).decode()]
    assert decode and all("ihr = " in src for src in decode)   # packed, and appended
    for i, f in enumerate(fams):
        if f == "attention":
            assert fams[i + 1:i + 3] == ["scatter", "scatter"], fams
    idx = torch.randint(0, 96, (1, 256), generator=torch.Generator().manual_seed(1))
    _same_decodes(on, off, idx, (6, 127, 254), model)


KV_EARLY = parse_variant("kv:fuse_append.APPEND_AFTER_ATTENTION=True,"
                         "codegen.ATTN_KV_BEFORE_WAIT=True,fuse_append.APPEND_IN_ATTENTION=False")


def test_key_blocks_before_the_wait(tmp_path):
    """codegen.ATTN_KV_BEFORE_WAIT (on by default): with the appends after it, a split decode
    attention loads its key and value blocks before gdc_wait(), where no node before it writes
    the caches. The race proof accepts that (the caches' only writers run after it; the input
    position's table words are behind the table writer's full edges), and a planted early read
    of a cache whose append runs before the attention is refused. Decode logits bit for bit the
    package without either knob's, with the appended position in the first split, at a split's
    last key and the next one's first (prompt 127: decodes at 127 and 128), and in the last slot."""
    import ast
    import copy

    from test_pdl import _repack

    model = _model(8, 2, max_seq=256)
    with applied(KV_EARLY):
        on = _compile(model, tmp_path / "on.grace", True, max_seq=256, pdl=True)
    off = _compile(model, tmp_path / "off.grace", False, max_seq=256, pdl=True)
    package = read_package(on)
    assert races.check_races(package.manifest) == [] and races.check_pre_wait(package) == []
    m = package.manifest
    early = [k for k in m["kernels"] if k["family"] == "attention"
             and "kt_early" in bytes(package.section(k["source"])).decode()]
    assert len(early) == 1   # the decode step's (seq=1) attention; prefill's is not split so
    src = bytes(package.section(early[0]["source"])).decode()
    pre = src[:src.index("gdc_wait()")]
    assert "kt_early = " in pre and "v_early = " in pre and "new_pos = " in pre
    idx = torch.randint(0, 96, (1, 256), generator=torch.Generator().manual_seed(1))
    _same_decodes(on, off, idx, (6, 127, 255))

    # the same early loads with the pass off (appends before the attention) are a race
    plain = read_package(off)
    pm = copy.deepcopy(plain.manifest)
    graph = next(g for g in pm["graphs"] if g["name"] == "seq=1")
    j = next(j for j, n in enumerate(graph["nodes"])
             if pm["kernels"][n["kernel"]]["family"] == "attention")
    node = graph["nodes"][j]
    kernel = pm["kernels"][node["kernel"]]
    assert node.get("programmatic")
    source = bytes(plain.section(kernel["source"])).decode()
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    cache = next(i for i, a in enumerate(node["args"]) if a.get("region") == "state")
    name = fn.args.args[cache].arg
    bad = source.replace("    gdc_launch_dependents()\n",
                         f"    gdc_launch_dependents()\n    early = tl.load({name})\n", 1)
    data = _repack(plain, pm, {kernel["source"]: bad.encode()})
    problems = races.check_pre_wait(read_package(data))
    assert any(f"loads through {name} before gdc_wait()" in p and "index_put" in p
               for p in problems), problems


def test_appends_last_puts_them_at_the_end_and_changes_no_value(tmp_path, packages):
    """fuse_append.APPENDS_LAST (off by default): the moved appends of every layer go to the end
    of the decode graph's kernel list, still leaves (nothing waits for them), and the decode is
    bit for bit the default package's."""
    model, on = packages(4, 2, True)
    with applied(parse_variant("last:fuse_append.APPENDS_LAST=True")):
        last = _compile(model, tmp_path / "last.grace", True)
    fams = _families(last)
    assert fams[-4:] == ["scatter"] * 4 and fams.count("attention") == 2
    m = read_package(last).manifest
    graph = next(g for g in m["graphs"] if g["name"] == "seq=1")
    scatters = {j for j, n in enumerate(graph["nodes"])
                if m["kernels"][n["kernel"]]["family"] == "scatter"}
    assert not any(set(n["deps"]) & scatters for n in graph["nodes"])
    assert races.check_races(m) == []
    idx = torch.randint(0, 96, (1, MAX_SEQ), generator=torch.Generator().manual_seed(3))
    for g, w in zip(_decode(last, idx, prompt=7, steps=3), _decode(on, idx, prompt=7, steps=3)):
        np.testing.assert_array_equal(g, w)


def test_capped_key_blocks_before_the_wait(tmp_path):
    """codegen.ATTN_SPLIT_BLOCK_ELEMS: a split decode step whose key block would pass the cap
    takes fewer keys a step and more splits (here 512 elements at head dimension 16: 32 keys,
    where the uncapped plan takes 128), and with its KV blocks before gdc_wait() the decode is
    bit for bit the same capped plan without either knob's (and eager's to 1e-5): the appended
    position in the first block, at a block's last key and the next one's first (prompt 63:
    decodes at 63 and 64), and in the last slot."""
    from grace.aot import codegen
    model = _model(4, 2, max_seq=256)   # dim 64 / 4 heads: head dimension 16
    plan = codegen.attention_plan(1, 4, 1, 256, 132, rep=2, packable=True, d=16)
    with applied(parse_variant("cap:codegen.ATTN_SPLIT_BLOCK_ELEMS=512")):
        capped = codegen.attention_plan(1, 4, 1, 256, 132, rep=2, packable=True, d=16)
        with applied(KV_EARLY):
            on = _compile(model, tmp_path / "on.grace", True, max_seq=256, pdl=True)
        off = _compile(model, tmp_path / "off.grace", False, max_seq=256, pdl=True)
    assert (plan.bn, capped.bn) == (128, 32) and capped.split == 4 * plan.split
    package = read_package(on)
    assert races.check_races(package.manifest) == [] and races.check_pre_wait(package) == []
    graph = next(g for g in package.manifest["graphs"] if g["name"] == "seq=1")
    grids = [n["grid"] for n in graph["nodes"]
             if package.manifest["kernels"][n["kernel"]]["family"] == "attention"]
    assert grids and all(g[2] == capped.split for g in grids)
    idx = torch.randint(0, 96, (1, 256), generator=torch.Generator().manual_seed(2))
    _same_decodes(on, off, idx, (5, 63, 255), model)


IN_ATTENTION = parse_variant("in:fuse_append.APPEND_AFTER_ATTENTION=True,"
                             "fuse_append.APPEND_IN_ATTENTION=True")


def _compile_in_attention(model, path, max_seq=MAX_SEQ, **options):
    return _compile(model, path, IN_ATTENTION, max_seq=max_seq, **options)


def _stores_the_caches(package):
    """The decode graph's attention kernels, each storing through two more parameters than the
    partials (or output) it writes: the two caches."""
    m = package.manifest
    graph = next(g for g in m["graphs"] if g["name"] == "seq=1")
    kernels = [m["kernels"][n["kernel"]] for n in graph["nodes"] if "kernel" in n]
    attention = [k for k in kernels if k["family"] == "attention"]
    return attention and all(len(k["writes"]) == 3 for k in attention)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])   # grouped-query and plain
def test_appends_inside_the_attention(tmp_path, packages, heads, kv_heads):
    """fuse_append.APPEND_IN_ATTENTION (on by default): the decode graph launches no append
    kernels; the attention stores this call's key and value into the caches itself. The race
    proof holds (the attention is the caches' only writer in the step), and the prompt, three
    decode steps (each reading the keys the steps before it stored) and generate() are bit for
    bit the package without the pass, and eager's logits and greedy tokens."""
    from grace.tools.interpret import generate_package

    model, _ = packages(heads, kv_heads, True)
    off = packages(heads, kv_heads, False)[1]
    path = _compile_in_attention(model, tmp_path / "in.grace",
                                 generate={"tokens": "idx", "positions": "input_pos"})
    fams = _families(path)
    assert fams.count("attention") == 2 and "scatter" not in fams
    prefill = _families(path, "seq=32")   # the prompt's graph keeps its append kernels
    assert prefill[:prefill.index("attention")].count("scatter") == 2
    package = read_package(path)
    assert _stores_the_caches(package)
    assert races.check_races(package.manifest) == [] and races.check_pre_wait(package) == []
    idx = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    got = _decode(path, idx)
    for g, w in zip(got, _decode(off, idx)):
        np.testing.assert_array_equal(g, w)
    for g, r in zip(got, _eager(model, idx)):
        err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
        assert err < 1e-5, err
    prompt = torch.randint(0, 96, (5,), generator=torch.Generator().manual_seed(3))
    assert generate_package(path, prompt.numpy(), 6).tolist() == model.greedy(prompt, 6)


def test_appends_inside_a_split_packed_attention(tmp_path):
    """Split keys and packed grouped-query heads, key blocks loaded before the wait: the first
    split's programs store the appends. Bit for bit the package without either pass at the
    cache's start, middle and end (the appended key in the first, a middle and the last split),
    and eager's values."""
    model = _model(8, 2, max_seq=256)
    path = _compile_in_attention(model, tmp_path / "in.grace", max_seq=256)
    off = _compile(model, tmp_path / "off.grace", False, max_seq=256)
    package = read_package(path)
    assert "scatter" not in _families(path) and _stores_the_caches(package)
    assert races.check_races(package.manifest) == [] and races.check_pre_wait(package) == []
    sources = [bytes(package.section(k["source"])).decode()
               for k in package.manifest["kernels"] if k["family"] == "attention"]
    decode = [s for s in sources if "ak_mask" in s]
    assert decode and all("ihr = " in s and "kt_early" in s for s in decode)
    idx = torch.randint(0, 96, (1, 256), generator=torch.Generator().manual_seed(1))
    _same_decodes(path, off, idx, (6, 127, 254), model)



STORES_FIRST = parse_variant("first:fuse_append.APPEND_AFTER_ATTENTION=True,"
                             "fuse_append.APPEND_IN_ATTENTION=True,"
                             "codegen.ATTN_APPEND_STORES_LAST=False")


def _decode_attention_source(path):
    package = read_package(path)
    assert races.check_races(package.manifest) == [] and races.check_pre_wait(package) == []
    sources = [bytes(package.section(k["source"])).decode()
               for k in package.manifest["kernels"] if k["family"] == "attention"]
    decode = [s for s in sources if "ak_mask" in s]
    assert len(decode) == 1
    return decode[0]


def test_append_stores_last(tmp_path):
    """codegen.ATTN_APPEND_STORES_LAST (on by default): a decode attention that stores its own
    appends loads their values where it did, before the key loop, and stores them after its
    partials, so no warp waits at a store before the loop's loads. (Its decodes are checked bit
    for bit against the package without the appends in the attention, and against eager, by
    test_appends_inside_a_split_packed_attention, which builds it by default.) A position past
    the cache is still reported, and the next call is clean."""
    from grace.runtime.errors import IndexOutOfRangeError

    model = _model(8, 2, max_seq=256)
    path = _compile_in_attention(model, tmp_path / "last.grace", max_seq=256)
    first = _compile(model, tmp_path / "first.grace", STORES_FIRST, max_seq=256)
    for p, last in ((path, True), (first, False)):
        body = _decode_attention_source(p).split("gdc_wait()")[1]
        loop = body.index("for j0 in range(")
        stores = [ln.strip() for ln in body.splitlines() if ln.strip().startswith("tl.store(")]
        assert "ak_mask" in stores[-2 if last else 0] and "av_mask" in stores[-1 if last else 1]
        # the appended values' loads before the loop either way; the stores before it or not
        assert any("tl.load(" in ln and "mask=ak_mask" in ln for ln in body[:loop].splitlines())
        assert body[:loop].count("tl.store(") == (0 if last else 2)
    idx = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(1))
    sess = InterpretSession(path)
    sess.run({"idx": idx[:, :6].numpy(), "input_pos": np.arange(6)})
    with pytest.raises(IndexOutOfRangeError):
        sess.run({"idx": idx[:, 6:7].numpy(), "input_pos": np.array([256])})
    good = sess.run({"idx": idx[:, 6:7].numpy(), "input_pos": np.array([6])})["out"]
    assert np.isfinite(good).all()
