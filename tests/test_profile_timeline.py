"""profile_kernels --timeline: exposed times from synthetic kernel spans (no GPU, no profiler)."""
import pytest

from grace.tools.profile_kernels import format_timeline, timeline

KERNELS = [{"name": "table_writer"}, {"name": "mean_k"}, {"name": "gemv_k", "family": "matmul"},
           {"name": "put_k"}]
W = {"region": "weights", "offset": 0, "nbytes": 4_000_000}
GRAPH = {"name": "seq=1", "nodes": [
    {"kernel": 0, "args": [], "label": "table_writer"},
    {"kernel": 1, "args": [], "label": "mean"},
    {"kernel": 2, "args": [W], "label": "mm"},
    {"kernel": 3, "args": [], "label": "index_put"},      # beside the second one
    {"kernel": 3, "args": [], "label": "index_put_1"},
    {"kernel": 2, "args": [W], "label": "mm_1+add_17"},
]}


def _call(t0):
    return [("table_writer", t0, t0 + 1),
            ("mean_k", t0 + 1, t0 + 3),
            ("gemv_k", t0 + 2, t0 + 6),      # launched early (PDL): only 3 µs past the mean
            ("put_k", t0 + 6, t0 + 7),
            ("put_k", t0 + 6, t0 + 8),       # its sibling: 1 µs more
            ("gemv_k", t0 + 7, t0 + 10)]     # 2 µs past the siblings' finish


def test_exposed_times_add_up_to_the_span():
    result = timeline(GRAPH, KERNELS, _call(0.0) + _call(100.0), iters=2)
    span = result["span_us"]
    exposed = [r["exposed_us"] for r in result["rows"]]
    assert span == 10.0
    assert result["gap_between_calls_us"] == 90.0   # the second call began 90 µs after the first ended
    assert exposed == [1.0, 2.0, 3.0, 1.0, 1.0, 2.0]
    assert sum(exposed) == span
    # where each node began and how long it ran (a PDL launch's span includes its wait)
    assert [r["start_us"] for r in result["rows"]] == [0.0, 1.0, 2.0, 6.0, 6.0, 7.0]
    assert [r["duration_us"] for r in result["rows"]] == [1.0, 2.0, 4.0, 1.0, 2.0, 3.0]
    text = format_timeline(result, top=3)
    groups = {line.split()[0]: line.split() for line in text.splitlines()[2:6]}
    # a GEMV of 4 MB in 3 µs exposed, another (its residual add fused) in 2 µs
    assert groups["mm"][1:3] == ["1", "3.0"] and groups["mm"][-1] == "1.33"
    assert groups["mm+add"][1:3] == ["1", "2.0"] and groups["mm+add"][-1] == "2.00"
    assert "index_put " in text and "index_put_1" not in text.split("the 3 nodes")[0]


def test_kernels_of_no_node_are_left_out_unless_one_is_missing():
    spans = _call(0.0)
    spans.insert(2, ("memset_like", 1.5, 1.6))   # other GPU work in the process: dropped
    assert timeline(GRAPH, KERNELS, spans, iters=1)["span_us"] == 10.0
    spans[4] = ("other", 6, 7)                    # ... but not in place of a node's kernel
    with pytest.raises(SystemExit, match=r"kernels of no node: \['memset_like', 'other'\]"):
        timeline(GRAPH, KERNELS, spans, iters=1)
    with pytest.raises(SystemExit, match="other GPU work"):
        timeline(GRAPH, KERNELS, _call(0.0)[:-1], iters=1)
    spans = _call(0.0)
    spans[3] = ("gemv_k", 6, 7)                   # a kernel more often than its nodes
    with pytest.raises(SystemExit, match="ran more often"):
        timeline(GRAPH, KERNELS, spans, iters=1)
