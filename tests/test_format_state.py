"""Format 3.0: session state (`regions.state`, `state`, state arguments, the `state` section) and
`generate`, the map that lets the runtime drive a causal LM on the device (docs/design-state.md).

The manifest here is a tiny LM: idx[1, seq], input_pos[seq] -> out[1, seq, 8], a KV cache in the
state region, one graph per bucket seq in {1, 8} (graph 0 is the decode graph) and a step node.
CPU only.
"""

import random

import numpy as np
import pytest
from test_format import (_flip_bytes, _set, fuzz_manifest_tree, make_manifest, make_sections, packed,
                         read_only_format_errors)

from grace.formats import (FORMAT_VERSION, FormatError, ManifestError, decode_state, decode_weights, encode_state,
                           encode_weights, read_package, validate_manifest, write_package)

CAPACITY = 8
WORDS = 5 + 3 + 7 + 1  # slot words (idx rank 2, input_pos rank 1, out rank 3), then the seq word
STEP_INIT = np.int64(3)

# name, dtype, shape, offset, init; nbytes follows from dtype and shape
STATE = [
    ("kv.k_cache", "float32", [1, 2, CAPACITY, 4], 0, "zeros"),
    ("step", "int64", [], 256, "data"),
    ("generate.ctrl", "int64", [4], 512, "zeros"),
    ("generate.out_tokens", "int64", [CAPACITY], 768, "zeros"),
    ("generate.next_token", "int64", [1, 1], 1024, "zeros"),
    ("generate.next_position", "int64", [1], 1280, "zeros"),
]
STATE_NBYTES = 1536


def _state_arg(name: str) -> dict:
    """The node argument for the whole of state entry `name`."""
    _, dtype, shape, off, _ = next(s for s in STATE if s[0] == name)
    return {"region": "state", "offset": off, "nbytes": _nbytes(dtype, shape), "dtype": dtype}


def _nbytes(dtype: str, shape: list) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _graph(seq: int) -> dict:
    return {
        "name": f"seq={seq}", "bucket": {"seq": seq}, "arena": 256,
        "nodes": [
            {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
             "args": [{"region": "table", "offset": 0, "nbytes": 144}]
             + [{"word": i} for i in range(WORDS)]},
            {"kernel": 1, "grid": [seq, 1, 1], "deps": [0], "label": "attention",
             "args": [{"region": "table", "offset": 0, "nbytes": 40},
                      {"region": "table", "offset": 48, "nbytes": 24},
                      {"region": "weights", "offset": 0, "nbytes": 256, "dtype": "float32"},
                      _state_arg("kv.k_cache"),
                      {"region": "table", "offset": 80, "nbytes": 56},
                      {"region": "arena", "offset": 0, "nbytes": 256, "dtype": "float32"}]},
        ],
    }


def make_state_manifest() -> dict:
    m = make_manifest()
    m["kernels"][0]["params"] = [{"name": "table_ptr", "type": "*i64"}] + [
        {"name": f"w{i}", "type": "i64"} for i in range(WORDS)]
    m["kernels"][1]["params"] = [
        {"name": "idx_slot", "type": "*i64"}, {"name": "pos_slot", "type": "*i64"},
        {"name": "w", "type": "*fp32"}, {"name": "cache", "type": "*fp32"},
        {"name": "out_slot", "type": "*i64"}, {"name": "tmp", "type": "*fp32"}]
    m["kernels"].append(
        {"name": "k_step", "family": "generate_step",
         "params": [{"name": n, "type": "*i64"} for n in
                    ("logits_slot", "pos_slot", "ctrl", "out_tokens", "next_token", "next_position")],
         "num_warps": 1, "shared": 0, "binaries": {"sm_90": "cubin/k_step.sm_90"}})
    m["symbols"] = [{"name": "seq", "kind": "input", "min": 1, "max": CAPACITY, "sources": [[0, 1], [1, 0]]}]
    m["inputs"] = [{"name": "idx", "dtype": "int64", "shape": [1, "seq"], "slot": 0},
                   {"name": "input_pos", "dtype": "int64", "shape": ["seq"], "slot": 1}]
    m["outputs"] = [{"name": "out", "dtype": "float32", "shape": [1, "seq", 8], "slot": 2}]
    m["table"] = {"nbytes": 144, "extents": {"offset": 136, "count": 1}, "slots": [
        {"name": "idx", "role": "input", "offset": 0, "rank": 2},
        {"name": "input_pos", "role": "input", "offset": 48, "rank": 1},
        {"name": "out", "role": "output", "offset": 80, "rank": 3}]}
    m["regions"] = {"weights": 512, "arena": 256, "table": 144, "state": STATE_NBYTES}
    m["arena_buffers"] = []
    m["state"] = [{"name": n, "dtype": d, "shape": s, "offset": o, "nbytes": _nbytes(d, s), "init": i}
                  for n, d, s, o, i in STATE]
    m["graphs"] = [_graph(1), _graph(CAPACITY)]
    m["generate"] = {
        "tokens": "idx", "positions": "input_pos", "logits": "out", "capacity": CAPACITY,
        "decode_graph": 0, "ctrl": "generate.ctrl", "out_tokens": "generate.out_tokens",
        "next_token": "generate.next_token", "next_position": "generate.next_position",
        "step": {"kernel": 2, "grid": [1, 1, 1], "deps": [], "label": "generate_step",
                 "args": [{"region": "table", "offset": 80, "nbytes": 56},
                          {"region": "table", "offset": 48, "nbytes": 24},
                          _state_arg("generate.ctrl"), _state_arg("generate.out_tokens"),
                          _state_arg("generate.next_token"), _state_arg("generate.next_position")]},
    }
    return m


def make_state_section() -> bytes:
    return encode_state({"step": ("int64", (), STEP_INIT.tobytes())})


def make_state_sections() -> dict:
    return {**make_sections(), "cubin/k_step.sm_90": b"\x7fELF" + bytes(200), "state": make_state_section()}


def _m(*fns) -> dict:
    m = make_state_manifest()
    for fn in fns:
        fn(m)
    return m


def _entry(i, key, value):
    return _set(["state", i, key], value)


def _gen(key, value):
    return _set(["generate", key], value)


def _pop(*path):
    def fn(m):
        obj = m
        for key in path[:-1]:
            obj = obj[key]
        del obj[path[-1]]
    return fn


# ---------------------------------------------------------------------------------------------
# Accepted


def test_state_manifest_is_valid():
    validate_manifest(make_state_manifest())
    validate_manifest(make_state_manifest(), section_names=make_state_sections())


def test_state_round_trip(tmp_path):
    manifest, sections = make_state_manifest(), make_state_sections()
    path = tmp_path / "lm.grace"
    write_package(path, manifest, sections)
    with read_package(path) as pkg:
        assert pkg.format_version == FORMAT_VERSION
        assert pkg.manifest == {**manifest, "format_version": list(FORMAT_VERSION)}
        tensors = decode_state(pkg.section("state"))
        # only init "data" entries have bytes in the file: the zero-filled cache costs nothing
        assert list(tensors) == ["step"]
        dtype, shape, view = tensors["step"]
        assert (dtype, shape) == ("int64", ())
        assert np.frombuffer(view, np.int64)[0] == STEP_INIT
        assert view.obj is pkg.section("state").obj  # zero-copy, like the weights


def test_state_codec_is_the_weights_codec():
    assert encode_state is encode_weights
    blob = make_state_section()
    assert decode_state(blob).keys() == decode_weights(blob).keys()
    with pytest.raises(FormatError, match=r"^state: safetensors blob is 3 bytes"):
        decode_state(b"abc")
    with pytest.raises(FormatError, match=r"^weights: safetensors blob is 3 bytes"):
        decode_weights(b"abc")


def test_state_variants_that_stay_valid():
    # zeros only: no state section needed
    only_zeros = _m(_entry(1, "init", "zeros"))
    sections = {k: v for k, v in make_state_sections().items() if k != "state"}
    validate_manifest(only_zeros, section_names=sections)
    read_package(packed(only_zeros, sections))
    # without generate: a stateful model that is not driven by generate()
    validate_manifest(_m(_pop("generate")))
    # zero-sized entries overlap nothing, even at the same offset as another entry
    validate_manifest(_m(lambda m: m["state"].append(
        {"name": "empty", "dtype": "float32", "shape": [0, 4], "offset": 0, "nbytes": 0, "init": "zeros"})))
    # a state range may be any part of the region, and is exactly at its end
    validate_manifest(_m(_set(["graphs", 0, "nodes", 1, "args", 3],
                              {"region": "state", "offset": STATE_NBYTES - 8, "nbytes": 8})))
    # the decode graph may be any graph; the logits any float dtype
    validate_manifest(_m(_gen("decode_graph", 1)))
    validate_manifest(_m(_set(["outputs", 0, "dtype"], "bfloat16")))
    # a step that uses no table slot at all
    validate_manifest(_m(_set(["generate", "step", "args", 0], _state_arg("generate.ctrl"))))


def test_extra_state_section_is_ignored():
    m = _m(_entry(1, "init", "zeros"))
    read_package(packed(m, make_state_sections()))  # a section nobody references MAY be present


# ---------------------------------------------------------------------------------------------
# Rejected by the schema


BAD_STATE = [
    (_set(["state"], {}), r"^state: expected a list, got dict"),
    (_entry(0, "offset", 128), r"^state\[0\]\.offset: 128 is not 256-aligned"),
    (_entry(1, "nbytes", 16), r"^state\[1\]\.nbytes: 16 bytes, but int64\[\] needs 8"),
    (_entry(3, "shape", [CAPACITY, 2]), r"^state\[3\]\.nbytes: 64 bytes, but int64\[8, 2\] needs 128"),
    (_entry(0, "shape", [1, -2, 8, 4]), r"^state\[0\]\.shape\[1\]: -2 is below the minimum 0"),
    (_entry(0, "dtype", "fp32"), r"^state\[0\]\.dtype: unknown dtype 'fp32'"),
    (_entry(2, "name", "step"), r"^state\[2\]\.name: duplicate state entry name 'step'"),
    (_entry(2, "name", 7), r"^state\[2\]\.name: expected a str, got int"),
    (_entry(2, "offset", 256), r"^state\[\d\]: state entry starting at 256 overlaps state\[\d\] \[256, 2\d\d\)"),
    # the cache grown past its neighbour: an overlap found through nbytes, not through the offset
    (lambda m: m["state"][0].update(shape=[1, 2, 9, 4], nbytes=288),
     r"^state\[1\]: state entry starting at 256 overlaps state\[0\] \[0, 288\)"),
    (_entry(5, "offset", STATE_NBYTES), r"^state\[5\]: state range \[1536, 1544\) exceeds the state region "
                                        r"\(1536 bytes\)"),
    (_set(["regions", "state"], 800),
     r"^state\[3\]: state range \[768, 832\) exceeds the state region \(800 bytes\)"),
    (_entry(1, "init", "ones"), r"^state\[1\]\.init: expected one of \('zeros', 'data'\), got 'ones'"),
    (_pop("state", 1, "init"), r"^state\[1\]: missing required key 'init'"),
    # state arguments of graph nodes
    (_set(["graphs", 1, "nodes", 1, "args", 3, "offset"], 1536 - 128),
     r"^graphs\[1\]\.nodes\[1\]\.args\[3\]: state range \[1408, 1664\) exceeds the state region"),
    (_set(["graphs", 1, "nodes", 1, "args", 3, "offset"], 1536),
     r"^graphs\[1\]\.nodes\[1\]\.args\[3\]: state range \[1536, 1792\) exceeds the state region \(1536 bytes\)"),
    (_set(["graphs", 0, "nodes", 0, "args", 1], {"region": "state", "offset": 0, "nbytes": 8}),
     r"^graphs\[0\]\.nodes\[0\]\.args\[1\]: state range passed to scalar parameter 'w0'"),
]


@pytest.mark.parametrize("fn, match", BAD_STATE)
def test_bad_state_rejected(fn, match):
    with pytest.raises(ManifestError, match=match):
        validate_manifest(_m(fn))


GENERATE_KEYS = ["tokens", "positions", "logits", "capacity", "decode_graph", "ctrl", "out_tokens",
                 "next_token", "next_position", "step"]


@pytest.mark.parametrize("key", GENERATE_KEYS)
def test_generate_missing_key(key):
    with pytest.raises(ManifestError, match=rf"^generate: missing required key '{key}'"):
        validate_manifest(_m(_pop("generate", key)))


def _grow_out_tokens(n):
    def fn(m):
        m["state"][3].update(shape=[n], nbytes=8 * n)
    return fn


BAD_GENERATE = [
    (_set(["generate"], [1]), r"^generate: expected a map, got list"),
    # inputs and outputs it names
    (_gen("tokens", "ids"), r"^generate\.tokens: 'ids' is not an input \(the inputs are \['idx', 'input_pos'\]\)"),
    (_gen("tokens", 0), r"^generate\.tokens: expected a str, got int"),
    (_gen("tokens", "input_pos"), r"^generate\.tokens: input 'input_pos' has rank 1, expected 2"),
    (_gen("tokens", "out"), r"^generate\.tokens: 'out' is not an input"),
    (_set(["inputs", 0, "dtype"], "int32"), r"^generate\.tokens: input 'idx' is int32, expected int64"),
    (_gen("positions", "idx"), r"^generate\.positions: input 'idx' has rank 2, expected 1"),
    (_set(["inputs", 1, "dtype"], "float32"), r"^generate\.positions: input 'input_pos' is float32, expected int64"),
    (_gen("logits", "idx"), r"^generate\.logits: 'idx' is not an output \(the outputs are \['out'\]\)"),
    (_set(["outputs", 0, "dtype"], "int64"),
     r"^generate\.logits: output 'out' is int64, expected float64 or float32 or float16 or bfloat16"),
    # sizes and the decode graph
    (_gen("capacity", 0), r"^generate\.capacity: 0 is below the minimum 1"),
    (_gen("capacity", True), r"^generate\.capacity: expected an int, got bool"),
    (_gen("decode_graph", 2), r"^generate\.decode_graph: graph 2 does not exist \(there are 2\)"),
    (_gen("decode_graph", -1), r"^generate\.decode_graph: graph -1 does not exist"),
    (_gen("decode_graph", "seq=1"), r"^generate\.decode_graph: expected an int, got str"),
    # the state entries it names
    (_gen("ctrl", "generate.control"), r"^generate\.ctrl: 'generate\.control' is not a state entry"),
    (_gen("ctrl", "step"), r"^generate\.ctrl: state entry 'step' is int64\[\], expected int64\[4\]"),
    (_gen("next_token", "kv.k_cache"),
     r"^generate\.next_token: state entry 'kv\.k_cache' is float32\[1, 2, 8, 4\], expected int64\[1, 1\]"),
    (_gen("capacity", 16), r"^generate\.out_tokens: state entry 'generate\.out_tokens' is int64\[8\], "
                           r"expected int64\[16\]"),
    (_gen("next_token", "generate.next_position"),
     r"^generate\.next_token: state entry 'generate\.next_position' is int64\[1\], expected int64\[1, 1\]"),
    (lambda m: m["state"][5].update(dtype="int32", nbytes=4),
     r"^generate\.next_position: state entry 'generate\.next_position' is int32\[1\], expected int64\[1\]"),
    (lambda m: (_gen("capacity", 4)(m), _grow_out_tokens(4)(m), _gen("out_tokens", "generate.ctrl")(m)),
     r"^generate\.out_tokens: state entry 'generate\.ctrl' is already generate\.ctrl"),
    # the step node
    (_gen("step", 2), r"^generate\.step: expected a map, got int"),
    (_set(["generate", "step", "deps"], [0]),
     r"^generate\.step\.deps: must be empty: the step is not part of a graph"),
    (_set(["generate", "step", "deps"], 0), r"^generate\.step\.deps: expected a list, got int"),
    (_set(["generate", "step", "args", 2], {"region": "arena", "offset": 0, "nbytes": 32}),
     r"^generate\.step\.args\[2\]: arena range \[0, 32\) exceeds the graph's arena \(0 bytes\)"),
    (_set(["generate", "step", "args", 3, "nbytes"], 1024),
     r"^generate\.step\.args\[3\]: state range \[768, 1792\) exceeds the state region \(1536 bytes\)"),
    (_set(["generate", "step", "kernel"], 3), r"^generate\.step\.kernel: kernel 3 does not exist"),
    (lambda m: m["generate"]["step"]["args"].pop(), r"^generate\.step\.args: 5 arguments for kernel 2"),
    (_set(["generate", "step", "grid"], [1, 0, 1]), r"^generate\.step\.grid\[1\]: 0 is below the minimum 1"),
    (_set(["generate", "step", "args", 0], {"word": 0}),
     r"^generate\.step\.args\[0\]: table word passed to parameter 'logits_slot' of type '\*i64'"),
]


@pytest.mark.parametrize("fn, match", BAD_GENERATE)
def test_bad_generate_rejected(fn, match):
    with pytest.raises(ManifestError, match=match):
        validate_manifest(_m(fn))


def test_step_may_use_a_zero_byte_arena_range():
    """The step's arena limit is 0 bytes: a zero-sized range touches nothing, so it is allowed."""
    validate_manifest(_m(_set(["generate", "step", "args", 2], {"region": "arena", "offset": 0, "nbytes": 0})))


# ---------------------------------------------------------------------------------------------
# Rejected by the reader and the writer: the state section


def _without_state_section() -> dict:
    return {k: v for k, v in make_state_sections().items() if k != "state"}


def test_missing_state_section_for_data_entries(tmp_path):
    match = r"^state\[1\]\.init: 'data', but the package has no 'state' section"
    with pytest.raises(ManifestError, match=match):
        validate_manifest(make_state_manifest(), section_names=_without_state_section())
    with pytest.raises(ManifestError, match=match):
        read_package(packed(make_state_manifest(), _without_state_section()))
    with pytest.raises(ManifestError, match=match):
        write_package(tmp_path / "m.grace", make_state_manifest(), _without_state_section())
    assert not (tmp_path / "m.grace").exists()
    validate_manifest(make_state_manifest())  # without section_names the check is skipped


@pytest.mark.parametrize("tensors, match", [
    ({"step": ("int32", (), np.int32(3).tobytes())},
     r"^state\[1\]: tensor 'step' is int32\[\] in the state section but int64\[\] in the manifest"),
    ({"step": ("int64", (1,), STEP_INIT.tobytes())},
     r"^state\[1\]: tensor 'step' is int64\[1\] in the state section but int64\[\] in the manifest"),
    ({"counter": ("int64", (), STEP_INIT.tobytes())}, r"^state\[1\]: tensor 'step' is not in the state section"),
    ({}, r"^state\[1\]: tensor 'step' is not in the state section"),
])
def test_state_section_must_match_manifest(tmp_path, tensors, match):
    sections = {**make_state_sections(), "state": encode_state(tensors)}
    with pytest.raises(ManifestError, match=match):
        read_package(packed(make_state_manifest(), sections))
    with pytest.raises(ManifestError, match=match):
        write_package(tmp_path / "m.grace", make_state_manifest(), sections)


@pytest.mark.parametrize("blob, match", [
    (b"", r"^state: safetensors blob is 0 bytes"),
    (b"\x08" + bytes(7) + b"not json", r"^state: safetensors header is not valid JSON"),
    (make_state_section() + b"\x00", r"^state: tensors cover 8 of 9 data bytes"),
])
def test_state_section_must_be_safetensors(tmp_path, blob, match):
    sections = {**make_state_sections(), "state": blob}
    with pytest.raises(FormatError, match=match) as info:
        read_package(packed(make_state_manifest(), sections))
    assert not isinstance(info.value, ManifestError)
    with pytest.raises(FormatError, match=match):
        write_package(tmp_path / "m.grace", make_state_manifest(), sections)


def test_state_section_is_not_decoded_without_data_entries():
    """As with the weights: a section nobody needs is not parsed, so junk there is harmless."""
    m = _m(_entry(1, "init", "zeros"))
    read_package(packed(m, {**make_state_sections(), "state": b"junk"}))


def test_reader_rejects_bad_state_written_without_validation():
    with pytest.raises(ManifestError, match=r"^generate\.step\.deps: must be empty"):
        read_package(packed(_m(_set(["generate", "step", "deps"], [0])), make_state_sections()))
    with pytest.raises(ManifestError, match=r"^state\[0\]\.offset: 128 is not 256-aligned"):
        read_package(packed(_m(_entry(0, "offset", 128)), make_state_sections()))


# ---------------------------------------------------------------------------------------------
# Fuzzing: only FormatError may escape


def test_fuzz_state_package_bytes(tmp_path):
    path = tmp_path / "lm.grace"
    write_package(path, make_state_manifest(), make_state_sections())
    original = path.read_bytes()
    rng = random.Random(4321)
    for _ in range(200):
        data = bytearray(original)
        if rng.random() < 0.8:
            _flip_bytes(rng, data, len(data), rng.randint(1, 8))
        else:
            start = rng.randrange(len(data))
            del data[start:start + rng.randint(1, 64)]
        assert data != original
        read_only_format_errors(bytes(data))


def test_fuzz_state_manifest_structure():
    fuzz_manifest_tree(make_state_manifest(), make_state_sections(), seed=11, rounds=400)
