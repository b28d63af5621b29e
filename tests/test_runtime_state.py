"""Session state and generate() in grace.runtime without a GPU (docs/design-state.md, SPEC.md §5.2).

Against test_runtime_nogpu.FakeDriver (host memory for device memory, graph calls recorded), extended
here with conditional nodes, PTX modules and a log of memsets / copies / launches:

  * state: one allocation of regions.state per session, initialised with a memset per `zeros` entry
    and a copy per `data` entry; reset_state() re-initialises in stream order; read_state() returns
    the entries' dtypes and shapes (bfloat16 as float32); sessions never share state; node arguments
    in the state region point at the session's state;
  * generate(): input checks before anything is enqueued; the order reset -> ctrl -> prefill ->
    one launch; the generation graph's structure (step -> set_condition -> decode writer -> WHILE
    { decode kernels, step, set_condition }) and parameters, built once per session;
  * the runtime's set_condition PTX assembles (ptxas, when Triton ships one).

Whether the driver runs the WHILE loop is tests/gpu/test_runtime_handmade.py's job.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess

import numpy as np
import pytest

import grace.runtime as rt
from grace.formats import ManifestError
from grace.runtime import driver, generate, graph
from grace.runtime.errors import GraceRuntimeError, InputError, InvalidPackageError

try:
    from test_runtime_nogpu import FakeDriver, read_params
    from test_runtime_nogpu import manifest as stateless_manifest
    from test_runtime_nogpu import write as write_stateless
except ImportError:  # tests/ imported as a package
    from tests.test_runtime_nogpu import FakeDriver, read_params
    from tests.test_runtime_nogpu import manifest as stateless_manifest
    from tests.test_runtime_nogpu import write as write_stateless

# ------------------------------------------------------------------------ a tiny causal "LM"

V, SEQ_MAX, CAPACITY = 8, 16, 16
# table: tokens [1, seq] at 0 (5 words), positions [seq] at 48 (3), logits [1, seq, V] at 80 (7), seq at 136
TOKENS_SLOT, POSITIONS_SLOT, LOGITS_SLOT, EXTENTS, TABLE = 0, 48, 80, 136, 144
N_WORDS = 5 + 3 + 7 + 1
STATE = {  # name: (dtype, shape, offset, init)
    "k_cache": ("float32", [SEQ_MAX, 4], 0, "zeros"),
    "bias": ("float32", [4], 256, "data"),
    "scale": ("bfloat16", [2], 512, "data"),
    "generate.ctrl": ("int64", [4], 768, "zeros"),
    "generate.out_tokens": ("int64", [CAPACITY], 1024, "zeros"),
    "generate.next_token": ("int64", [1, 1], 1280, "zeros"),
    "generate.next_position": ("int64", [1], 1536, "zeros"),
}
STATE_NBYTES = 1792
BIAS = np.array([1.5, -2.0, 0.25, 4.0], np.float32)
SCALE_BITS = np.array([0x3FC0, 0xC040], np.uint16)  # bfloat16 1.5, -3.0
ITEM = {"float32": 4, "bfloat16": 2, "int64": 8}


def _nbytes(dtype, shape):
    return int(np.prod(shape, dtype=np.int64)) * ITEM[dtype]


def _kernel(name, params, warps=4):
    return {"name": name, "family": "pointwise", "num_warps": warps, "num_stages": 1, "shared": 0,
            "params": params, "hidden_params": 2, "global_scratch_size": 0, "profile_scratch_size": 0,
            "binaries": {"sm_90": f"cubin/{name}.sm_90"}}


def _ptr(name, t="*i64"):
    return {"name": name, "type": t}


def table(off, nbytes):
    return {"region": "table", "offset": off, "nbytes": nbytes, "dtype": "int64"}


def state_arg(name):
    dtype, shape, offset, _ = STATE[name]
    return {"region": "state", "offset": offset, "nbytes": _nbytes(dtype, shape), "dtype": dtype}


def lm_manifest(**over) -> dict:
    """tokens [1, seq], positions [seq] -> logits [1, seq, 8], seq in [1, 16]; graphs seq=16 (0) and
    seq=1 (1, the decode graph). Each graph: table writer; k_body (reads the slots, writes the
    k_cache state and the arena); k_head (arena -> logits, after k_body); k_side (after the writer
    only): the decode body has two sinks. generate.step reads the logits and positions slots and
    writes the four generate.* state entries."""
    kernels = [
        _kernel("table_writer", [_ptr("table")] + [{"name": f"w{k}", "type": "i64"} for k in range(N_WORDS)], 1),
        _kernel("k_body", [_ptr("tokens_slot"), _ptr("positions_slot"), _ptr("ext"), _ptr("cache", "*fp32"),
                           _ptr("bias", "*fp32"), _ptr("t", "*fp32")]),
        _kernel("k_head", [_ptr("t", "*fp32"), _ptr("logits_slot")]),
        _kernel("k_side", [_ptr("ext")]),
        _kernel("k_step", [_ptr("logits_slot"), _ptr("positions_slot"), _ptr("ctrl"), _ptr("out_tokens"),
                           _ptr("next_token"), _ptr("next_position")], 1),
    ]

    def graph_of(bound):
        arena = 256 * bound
        t = {"region": "arena", "offset": 0, "nbytes": arena, "dtype": "float32"}
        ext = table(EXTENTS, 8)
        return {"name": f"seq={bound}", "bucket": {"seq": bound}, "arena": arena, "nodes": [
            {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
             "args": [{"region": "table", "offset": 0, "nbytes": TABLE}] + [{"word": w} for w in range(N_WORDS)]},
            {"kernel": 1, "grid": [bound, 1, 1], "deps": [0], "label": "body",
             "args": [table(TOKENS_SLOT, 40), table(POSITIONS_SLOT, 24), ext, state_arg("k_cache"),
                      state_arg("bias"), t]},
            {"kernel": 2, "grid": [bound, 1, 1], "deps": [0, 1], "label": "head", "args": [t, table(LOGITS_SLOT, 56)]},
            {"kernel": 3, "grid": [1, 1, 1], "deps": [0], "label": "side", "args": [ext]},
        ]}

    state = [{"name": n, "dtype": d, "shape": s, "offset": o, "nbytes": _nbytes(d, s), "init": i}
             for n, (d, s, o, i) in STATE.items()]
    step = {"kernel": 4, "grid": [1, 1, 1], "deps": [], "label": "generate_step",
            "args": [table(LOGITS_SLOT, 56), table(POSITIONS_SLOT, 24), state_arg("generate.ctrl"),
                     state_arg("generate.out_tokens"), state_arg("generate.next_token"),
                     state_arg("generate.next_position")]}
    m = {
        "format_version": [3, 0], "producer": {"grace": "0.1.0"}, "model": {"name": "tiny_lm"},
        "archs": ["sm_90"], "options": {},
        "symbols": [{"name": "seq", "kind": "input", "min": 1, "max": SEQ_MAX, "sources": [[0, 1], [1, 0]]}],
        "inputs": [{"name": "idx", "dtype": "int64", "shape": [1, "seq"], "slot": 0},
                   {"name": "input_pos", "dtype": "int64", "shape": ["seq"], "slot": 1}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": [1, "seq", V], "slot": 2}],
        "table": {"nbytes": TABLE, "extents": {"offset": EXTENTS, "count": 1},
                  "slots": [{"name": "idx", "role": "input", "offset": TOKENS_SLOT, "rank": 2},
                            {"name": "input_pos", "role": "input", "offset": POSITIONS_SLOT, "rank": 1},
                            {"name": "logits", "role": "output", "offset": LOGITS_SLOT, "rank": 3}]},
        "regions": {"weights": 0, "arena": 256 * SEQ_MAX, "table": TABLE, "state": STATE_NBYTES},
        "weights": [], "state": state, "arena_buffers": [], "kernels": kernels,
        "graphs": [graph_of(SEQ_MAX), graph_of(1)],
        "generate": {"tokens": "idx", "positions": "input_pos", "logits": "logits", "capacity": CAPACITY,
                     "decode_graph": 1, "ctrl": "generate.ctrl", "out_tokens": "generate.out_tokens",
                     "next_token": "generate.next_token", "next_position": "generate.next_position",
                     "step": step},
    }
    m.update(over)
    return m


def sections(m) -> dict:
    from grace.formats import encode_weights

    s = {f"cubin/{k['name']}.sm_90": b"\x7fELF fake " + k["name"].encode() for k in m["kernels"]}
    s["state"] = encode_weights({"bias": ("float32", (4,), BIAS.tobytes()),
                                 "scale": ("bfloat16", (2,), SCALE_BITS.tobytes())})
    return s


def write_lm(path, m=None):
    from grace.formats import write_package

    m = m or lm_manifest()
    write_package(path, m, sections(m))
    return path


# ------------------------------------------------------------------------ the fake driver

class StateFake(FakeDriver):
    """FakeDriver plus: PTX modules, conditional handles, cuGraphAddNode (WHILE nodes, whose body
    graphs get handles 0x9000 + k), and `log`: ("memset", ptr, n) / ("htod", dst, n) / ("launch",
    exec) in call order. A launch of the generation graph calls `on_generate(fake)` if set (the test
    plays the step kernel there)."""

    def __init__(self):
        super().__init__(n_params={"table_writer": 1 + N_WORDS + 2})
        self.log = []
        self.ptx = []
        self.handles = []          # (graph, ctx, default, flags) per cuGraphConditionalHandleCreate
        self.conditionals = {}     # graph node index -> (graph, handle, type, size, body graph)
        self._bodies = []          # the phGraph_out arrays the fake "driver" owns
        self.gen_execs = set()
        self.gen_launches = 0
        self.on_generate = None

    def cuModuleLoadData(self, image):
        if bytes(image).startswith(b".version"):
            self.ptx.append(bytes(image))
            return (self.ok, self._real.CUmodule(0x200 + len(self.ptx)))
        return super().cuModuleLoadData(image)

    def cuMemsetD8Async(self, p, value, n, stream):
        self.log.append(("memset", int(p), n))
        return super().cuMemsetD8Async(p, value, n, stream)

    def cuMemcpyHtoD(self, dst, src, n):
        self.log.append(("htod", int(dst), n))
        return super().cuMemcpyHtoD(dst, src, n)

    def cuGraphConditionalHandleCreate(self, g, ctx, default, flags):
        self.handles.append((int(g), int(ctx), default, flags))
        return (self.ok, self._real.CUgraphConditionalHandle(0xC0DE0 + len(self.handles)))

    def cuGraphAddNode(self, g, deps, edge_data, n, p):
        assert n == len(deps) and edge_data is None
        assert p.type == self._real.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        c = p.conditional
        body = 0x9000 + len(self._bodies)
        arr = (ctypes.c_uint64 * 1)(body)
        self._bodies.append(arr)
        ctypes.c_uint64.from_address(c.getPtr() + 16).value = ctypes.addressof(arr)  # phGraph_out
        self.nodes.append(("<conditional>", None, None, None, None, [int(d) - 1 for d in deps], int(g)))
        self.conditionals[len(self.nodes) - 1] = (int(g), int(c.handle), c.type, c.size, body)
        return (self.ok, self._real.CUgraphNode(len(self.nodes)))

    def cuGraphInstantiate(self, g, flags):
        if any(graph == int(g) for graph, *_ in self.conditionals.values()):
            self.gen_execs.add(int(g) + 0x1000)
        return super().cuGraphInstantiate(g, flags)

    def cuGraphLaunch(self, e, s):
        self.log.append(("launch", int(e)))
        if int(e) in self.gen_execs:
            self.gen_launches += 1
            if self.on_generate is not None:
                self.on_generate(self)
            return (self.ok,)
        return super().cuGraphLaunch(e, s)


@pytest.fixture
def fake(monkeypatch):
    pytest.importorskip("cuda.bindings.driver")
    f = StateFake()
    monkeypatch.setattr(driver, "_cu", f)
    return f


@pytest.fixture
def pkg(fake, tmp_path):
    p = rt.load(write_lm(tmp_path / "lm.grace"))
    yield p
    p.close()


def mem(ptr, dtype, n):
    """A numpy view of n elements of fake device memory."""
    ctype = {"int64": ctypes.c_int64, "float32": ctypes.c_float, "uint16": ctypes.c_uint16,
             "uint8": ctypes.c_uint8}[dtype]
    return np.ctypeslib.as_array((ctype * n).from_address(ptr))


def off(name):
    return STATE[name][2]


# ------------------------------------------------------------------------ state

def test_the_test_manifest_is_valid_format_3():
    from grace.formats import validate_manifest

    validate_manifest(lm_manifest(), section_names=set(sections(lm_manifest())))


def test_load_plans_state_entries_and_keeps_the_initial_bytes(pkg):
    assert [e.name for e in pkg.state] == list(STATE)
    data = {e.name: e.data for e in pkg.state if e.init == "data"}
    assert data["bias"].tobytes() == BIAS.tobytes() and data["scale"].tobytes() == SCALE_BITS.tobytes()
    assert all(e.data is None for e in pkg.state if e.init == "zeros")
    # node arguments in the state region are planned like any other region
    body = pkg.plans[0][1]
    assert body.args[3] == ("region", "state", 0) and body.args[4] == ("region", "state", 256)
    assert pkg.generate.decode_graph == 1 and pkg.generate.step.args[2] == ("region", "state", 768)


def test_a_session_allocates_and_initialises_its_state(fake, pkg):
    sess = pkg.session(poison=True)
    assert fake.memory[sess._state][1] == STATE_NBYTES
    zeros = [(sess._state + o, _nbytes(d, s)) for n, (d, s, o, i) in STATE.items() if i == "zeros"]
    assert [e[1:] for e in fake.log if e[0] == "memset" and e[1] >= sess._state
            and e[1] < sess._state + STATE_NBYTES] == zeros
    assert ("htod", sess._state + 256, 16) in fake.log and ("htod", sess._state + 512, 4) in fake.log
    np.testing.assert_array_equal(mem(sess._state + 256, "float32", 4), BIAS)
    np.testing.assert_array_equal(mem(sess._state + 512, "uint16", 2), SCALE_BITS)
    assert not mem(sess._state, "uint8", 256).any()  # k_cache zero-filled, not poisoned


def test_state_arguments_point_into_the_sessions_state(fake, pkg):
    s1, s2 = pkg.session(), pkg.session()
    assert s1._state != s2._state
    s1.run(idx=np.zeros((1, 3), np.int64), input_pos=np.arange(3))
    s2.run(idx=np.zeros((1, 3), np.int64), input_pos=np.arange(3))
    bodies = [n for n in fake.nodes if n[0] == "k_body"]
    assert [read_params(n[4], 8)[3:5] for n in bodies] == [[s1._state, s1._state + 256], [s2._state, s2._state + 256]]


def test_two_sessions_never_share_state(fake, pkg):
    s1, s2 = pkg.session(), pkg.session()
    mem(s1._state, "float32", 64)[:] = 7.0  # what a kernel of s1's graph would write
    assert (s1.read_state("k_cache") == 7).all() and not s2.read_state("k_cache").any()


def test_reset_state_reinitialises_after_earlier_runs(fake, pkg):
    sess = pkg.session()
    sess.run(idx=np.zeros((1, 2), np.int64), input_pos=np.arange(2))
    mem(sess._state, "float32", 64)[:] = 3.0
    mem(sess._state + 256, "float32", 4)[:] = 0.0
    mark = len(fake.log)
    sess.reset_state()
    assert fake.log[mark - 1][0] == "launch"  # the run was enqueued before the reset's memsets
    assert [e[0] for e in fake.log[mark:]] == ["memset", "htod", "htod", "memset", "memset", "memset", "memset"]
    state = sess.read_state()
    assert not state["k_cache"].any()
    np.testing.assert_array_equal(state["bias"], BIAS)


def test_read_state_has_the_entries_dtypes_and_shapes(fake, pkg):
    sess = pkg.session()
    state = sess.read_state()
    assert list(state) == list(STATE)
    for name, (dtype, shape, _, _) in STATE.items():
        want = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
        assert state[name].dtype == want and state[name].shape == tuple(shape), name
    assert state["scale"].tolist() == [1.5, -3.0]  # bfloat16 widened to float32, like DeviceArray.numpy()
    np.testing.assert_array_equal(sess.read_state("bias"), BIAS)
    with pytest.raises(InputError, match=r"unknown state 'nope'; the package's state is \['k_cache'"):
        sess.read_state("nope")


def test_a_stateless_package_allocates_no_state(fake, tmp_path):
    pkg = rt.load(write_stateless(tmp_path / "m.grace"))
    sess = pkg.session()
    assert sess._state is None and sess.read_state() == {} and pkg.generate is None
    with pytest.raises(GraceRuntimeError, match="not compiled with --generate"):
        sess.generate([1, 2], 3)
    pkg.close()


def test_kernels_without_hidden_params_get_none():
    """SPEC: hidden_params is optional; absent means 0 (formats.view fills the default)."""
    m = stateless_manifest()
    for k in m["kernels"]:
        del k["hidden_params"]
    plans = graph.plan_graph(m)
    assert len(plans[1].args) == 3


def test_close_frees_the_state(fake, pkg):
    before = set(fake.memory)
    sess = pkg.session()
    state = sess._state
    sess.close()
    assert state not in fake.memory and set(fake.memory) <= before


@pytest.mark.parametrize("arg, message", [
    ({"region": "state", "offset": 1536, "nbytes": 512},
     r"state range \[1536, 2048\) exceeds the state region \(1792 bytes\)"),
    ({"region": "state", "offset": -8, "nbytes": 8}, r"args\[3\].offset: -8 is below the minimum 0"),
])
def test_plan_rejects_state_arguments_out_of_range(arg, message):
    m = lm_manifest()
    m["graphs"][1]["nodes"][1]["args"][3] = arg
    with pytest.raises(ManifestError, match=message):
        graph.plan_graph(m, 1)


def test_plan_rejects_a_step_that_touches_the_arena():
    m = lm_manifest()
    m["generate"]["step"]["args"][2] = {"region": "arena", "offset": 0, "nbytes": 32}
    with pytest.raises(ManifestError, match=r"generate.step.args\[2\]: arena range \[0, 32\) exceeds the graph's arena \(0"):
        generate.GeneratePlan(m, [])


# ------------------------------------------------------------------------ generate: checks

@pytest.mark.parametrize("args, message", [
    (([[1, 2], [3, 4]], 4), r"prompt_ids must be 1-D or \[1, P\], got shape \[2, 2\]"),
    ((np.zeros((1, 1, 3), np.int64), 4), r"must be 1-D or \[1, P\]"),
    (([], 4), "the prompt is empty"),
    (([1.5, 2.0], 4), "prompt_ids must be integers, got float64"),
    ((list(range(1, 8)) * 3, 1),
     r"the prompt has 21 tokens, but symbol 'seq' \(the length of input 'idx'\) is in \[1, 16\]"),
    (([1, 9], 2), r"prompt token ids must be in \[0, 8\)"),
    (([1, 2], 0), "max_new_tokens must be an int >= 1, got 0"),
    (([1, 2], 2.0), "max_new_tokens must be an int >= 1"),
    (([1, 2], True), "max_new_tokens must be an int >= 1"),
    ((list(range(8)), 10), r"the prompt \(8 tokens\) \+ max_new_tokens \(10\) - 1 = 17 exceeds the cache "
                           r"capacity of 16 positions; at most 9 new tokens fit"),
    (([1, 2], 3, -2), "eos_token_id must be None or an int >= 0"),
])
def test_generate_checks_everything_before_anything_runs(fake, pkg, args, message):
    sess = pkg.session()
    mark = len(fake.log)
    with pytest.raises(InputError, match=message):
        sess.generate(*args)
    assert fake.log[mark:] == [] and fake.launches == [] and fake.nodes == [] and sess.last_generate is None


def test_prompt_at_the_limits_is_accepted(fake, pkg):
    sess = pkg.session()
    sess.generate(np.arange(8).reshape(1, 8) % V, 9)  # [1, P], exactly filling the capacity
    sess.generate(np.array([3], np.int32), 1)


# ------------------------------------------------------------------------ generate: the graph

def _play_step(tokens):
    """An on_generate hook: what the step kernels would leave in ctrl and out_tokens."""
    def hook(fake):
        sess = hook.session
        mem(sess._state + off("generate.out_tokens"), "int64", CAPACITY)[:len(tokens)] = tokens
        mem(sess._state + off("generate.ctrl"), "int64", 4)[[0, 3]] = [len(tokens), 1]
    return hook


def test_generate_resets_writes_ctrl_prefills_and_launches_once(fake, pkg):
    sess = pkg.session()
    hook = _play_step([5, 6, 7])
    hook.session = sess
    fake.on_generate = hook
    mem(sess._state, "float32", 64)[:] = 9.0  # a cache left over from earlier calls
    mark = len(fake.log)
    got = sess.generate([4, 1, 2], 5, eos_token_id=7)
    assert got.dtype == np.int64 and got.tolist() == [5, 6, 7]
    assert sess.last_generate == {"prompt": 3, "new_tokens": 3, "graph": "seq=16"}

    log = fake.log[mark:]
    state = sess._state
    reset = [e for e in log[:7]]
    assert [e[0] for e in reset] == ["memset", "htod", "htod", "memset", "memset", "memset", "memset"]
    assert log[7] == ("htod", state + off("generate.ctrl"), 32)
    staging = [sess._staging["idx"], sess._staging["input_pos"]]
    assert [e[1] for e in log[8:10]] == staging  # the prefill's numpy inputs
    assert [e[0] for e in log[10:]] == ["launch", "launch"] and fake.gen_launches == 1
    assert not sess.read_state("k_cache").any()  # reset before the prefill

    prefill = fake.launches[-1][1:-2]  # the prefill's table words: [1, 3] tokens, [3] positions, seq 3
    assert prefill == [staging[0], 1, 3, 3, 1, staging[1], 3, 1, sess._out_ptrs[0], 1, 3, V, 3 * V, V, 1, 3]
    np.testing.assert_array_equal(mem(staging[0], "int64", 3), [4, 1, 2])
    np.testing.assert_array_equal(mem(staging[1], "int64", 3), [0, 1, 2])


def test_the_ctrl_words(fake, pkg):
    sess = pkg.session()
    seen = []
    fake.on_generate = lambda f: seen.append(mem(sess._state + off("generate.ctrl"), "int64", 4).tolist())
    assert sess.generate([1], 4).tolist() == []  # the fake loop generated nothing: count 0
    sess.generate([1], 2, eos_token_id=3)
    assert seen == [[0, 4, -1, 0], [0, 2, 3, 0]]


def _graph_nodes(fake, g):
    return [(i, n) for i, n in enumerate(fake.nodes) if n[6] == g]


def test_the_generation_graph(fake, pkg):
    sess = pkg.session()
    sess.generate([1, 2], 3)
    (index, (g, handle, ctype, size, body)), = fake.conditionals.items()
    assert ctype == fake.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE and size == 1
    assert fake.handles == [(g, 0xC0, 0, 0)]
    state, table_ptr = sess._state, sess._table

    top = _graph_nodes(fake, g)
    assert [n[0] for _, n in top] == ["k_step", "grace_set_condition", "table_writer", "<conditional>"]
    ids = [i for i, _ in top]
    assert [n[5] for _, n in top] == [[], [ids[0]], [ids[1]], [ids[2]]]

    inner = _graph_nodes(fake, body)
    assert [n[0] for _, n in inner] == ["k_body", "k_head", "k_side", "k_step", "grace_set_condition"]
    b = [i for i, _ in inner]
    assert [n[5] for _, n in inner] == [[], [b[0]], [], [b[1], b[2]], [b[3]]]  # writer deps dropped
    assert [n[1] for _, n in inner[:3]] == [(1, 1, 1)] * 3  # the decode graph's (seq=1) grids

    # set_condition: (handle, ctrl); one thread
    for _, n in (top[1], inner[4]):
        assert read_params(n[4], 2) == [handle, state + off("generate.ctrl")] and n[2] == (1, 1, 1)
    # the step: logits and positions slots, the four generate.* entries, two hidden zeros
    step = [table_ptr + LOGITS_SLOT, table_ptr + POSITIONS_SLOT] + [
        state + off(k) for k in ("generate.ctrl", "generate.out_tokens", "generate.next_token",
                                 "generate.next_position")] + [0, 0]
    assert read_params(top[0][1][4], 8) == step and read_params(inner[3][1][4], 8) == step
    # the decode table words: tokens/positions fed back from the state, outputs at the session's buffer
    writer = read_params(top[2][1][4], 1 + N_WORDS + 2)
    assert writer == [table_ptr,
                      state + off("generate.next_token"), 1, 1, 1, 1,
                      state + off("generate.next_position"), 1, 1,
                      sess._out_ptrs[0], 1, 1, V, V, V, 1,
                      1, 0, 0]
    # the body's kernels use the session's state, table and arena like the decode graph's own
    assert read_params(inner[0][1][4], 8)[3:6] == [state, state + 256, sess._arena]
    assert fake.ptx and fake.ptx[0].startswith(b".version 8.0") and fake.ptx[0].endswith(b"\0")


def test_the_generation_graph_is_built_once_per_session(fake, pkg):
    s1 = pkg.session()
    for n in (3, 1, 2):
        s1.generate([1] * n, 2)
    # prefills of 3 and 2 tokens run in seq=16, of 1 in seq=1; the loop is one graph for all
    assert s1.instantiations == {"seq=16": 1, "seq=1": 1, "generate": 1} and len(fake.conditionals) == 1
    assert fake.gen_launches == 3
    s2 = pkg.session()
    s2.generate([1], 1)
    assert len(fake.conditionals) == 2 and len(fake.ptx) == 1  # set_condition: loaded once per package


def test_a_wrong_count_is_reported(fake, pkg):
    sess = pkg.session()
    fake.on_generate = lambda f: mem(sess._state + off("generate.ctrl"), "int64", 4).__setitem__(0, 99)
    with pytest.raises(InvalidPackageError, match=r"counted 99 tokens, outside \[0, 4\]"):
        sess.generate([1], 4)


def test_outputs_of_an_earlier_run_go_stale(fake, pkg):
    sess = pkg.session()
    out = sess.run(idx=np.zeros((1, 2), np.int64), input_pos=np.arange(2))["logits"]
    sess.generate([1], 2)
    with pytest.raises(rt.StaleOutputError):
        out.numpy()


def test_a_decode_graph_that_one_token_does_not_select_is_reported(fake, tmp_path):
    m = lm_manifest()
    m["generate"]["decode_graph"] = 0  # seq=16: one token selects seq=1
    pkg = rt.load(write_lm(tmp_path / "lm.grace", m))
    with pytest.raises(InvalidPackageError, match=r"decode_graph is 'seq=16', but one token selects graph 'seq=1'"):
        pkg.session().generate([1], 2)
    assert fake.gen_launches == 0
    pkg.close()


# ------------------------------------------------------------------------ set_condition PTX

def _ptxas():
    """Triton's bundled ptxas, if Triton is installed (no import: Triton is heavy)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else None


PTXAS = _ptxas()


@pytest.mark.skipif(PTXAS is None, reason="no ptxas (Triton's NVIDIA backend) here")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_set_condition_ptx_assembles(tmp_path, arch):
    ptx = tmp_path / "set_condition.ptx"
    ptx.write_text(generate.SET_CONDITION_PTX)
    r = subprocess.run([PTXAS, f"-arch={arch}", str(ptx), "-o", str(tmp_path / "out.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "grace_set_condition" in generate.SET_CONDITION_PTX and generate.SET_CONDITION_NAME == "grace_set_condition"


# ------------------------------------------------------------------------ the handmade packages

def test_the_handmade_state_packages_through_the_fake_driver(monkeypatch, tmp_path):
    """tests/helpers_handmade.py's counter and LM packages (real cubins, as the GPU tests load them):
    valid format 3.0, state initialised from the package, the LM's generation graph planned."""
    pytest.importorskip("triton")
    try:
        import helpers_handmade as hm
    except ImportError:
        from tests import helpers_handmade as hm
    fake = StateFake()
    fake.n_params["table_writer"] = 1 + 10 + 2
    monkeypatch.setattr(driver, "_cu", fake)
    pkg = rt.load(hm.build_counter_package(tmp_path / "counter.grace"))
    sess = pkg.session()
    assert sess.read_state("calls").tolist() == [hm.CALLS_START] and not sess.read_state("acc").any()
    pkg.close()

    fake.n_params["table_writer"] = 1 + 16 + 2
    pkg = rt.load(hm.build_lm_package(tmp_path / "lm.grace"))
    sess = pkg.session()
    assert sess.generate([3, 1], 4).tolist() == []  # the fake runs no kernel: count stays 0
    (g, _, _, _, body), = [v for v in fake.conditionals.values()]
    assert [n[0] for n in fake.nodes if n[6] == g] == ["k_step", "grace_set_condition", "table_writer",
                                                         "<conditional>"]
    assert [n[0] for n in fake.nodes if n[6] == body] == ["k_lm", "k_step", "grace_set_condition"]
    pkg.close()
