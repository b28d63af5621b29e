"""Index checks (format 3.3, SPEC §5.4) with the real runtime (H200): a gather whose index is out of
range reads a clamped row on the device (never memory outside its table) and stores a code into the
table's error word; the session reports it at the next synchronising point (.numpy(), sync(), a
data-dependent shape) as IndexOutOfRangeError naming the input, clears it, and the next good call
works. The CPU side (interpreter, manifest, races) is tests/test_index_checks.py.

Run with `pytest -m gpu tests/gpu`.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)

from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.runtime import IndexOutOfRangeError, load  # noqa: E402

VOCAB, DIM = 1000, 64


class Emb(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, 32)

    def forward(self, input_ids):
        return self.proj(self.emb(input_ids))


class Selected(torch.nn.Module):
    """A data-dependent output (boolean-mask selection) after a gather: its shape is read from the
    device, a synchronising point of its own."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)

    def forward(self, input_ids):
        return self.emb(input_ids)[input_ids > 500]


def _eager(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():   # torch's embedding refuses negative ids; grace wraps them
        return model(torch.from_numpy(ids % VOCAB)).numpy()


@pytest.fixture(scope="module")
def emb(tmp_path_factory):
    torch.manual_seed(0)
    model = Emb().eval()
    tmp = tmp_path_factory.mktemp("checks")
    seq = Dim("seq", min=1, max=64)
    path = grace_compile(model, (torch.randint(0, VOCAB, (2, 9)),), output=tmp / "emb.grace",
                         progress=False, fp32_matmul="ieee",
                         dynamic_shapes={"input_ids": {1: seq}}, buckets={"seq": [16, 64]})
    return model, load(path)


def _ids(seq: int, seed: int = 0) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, VOCAB, (2, seq)).astype(np.int64)
    ids[0, 0], ids[1, -1] = -1, -VOCAB   # negative ids wrap
    return ids


def test_good_ids_match_eager(emb):
    model, pkg = emb
    sess = pkg.session(poison=True)
    for seq in (9, 16, 37):   # inside a bucket (padded positions are masked), at a bound, the next one
        ids = _ids(seq, seq)
        got = sess.run(input_ids=ids)["out"].numpy()
        np.testing.assert_allclose(got, _eager(model, ids), rtol=1e-5, atol=1e-5)
    sess.sync()


@pytest.mark.parametrize("bad_id", [VOCAB, -VOCAB - 1, 2**40])
def test_out_of_range_id_raises_at_numpy_then_a_good_call_works(emb, bad_id):
    model, pkg = emb
    sess = pkg.session(poison=True)
    ids = _ids(12)
    bad = ids.copy()
    bad[1, 5] = bad_id
    out = sess.run(input_ids=bad)["out"]    # asynchronous: nothing is reported yet
    with pytest.raises(IndexOutOfRangeError) as info:
        out.numpy()
    msg = str(info.value)
    assert msg.startswith(f"input 'input_ids': an index is outside [-{VOCAB}, {VOCAB}) in aten.embedding")
    assert "test_index_checks_gpu.py" in msg and isinstance(info.value, IndexError)
    # the word was cleared; the kernels read row 0 for the bad id, never memory outside the table
    clamped = out.numpy()
    assert not np.isnan(clamped).any()
    fixed = bad.copy()
    fixed[1, 5] = 0
    np.testing.assert_allclose(clamped, _eager(model, fixed), rtol=1e-5, atol=1e-5)
    got = sess.run(input_ids=ids)["out"].numpy()
    np.testing.assert_allclose(got, _eager(model, ids), rtol=1e-5, atol=1e-5)


def test_sync_reports_device_inputs_too(emb):
    model, pkg = emb
    sess = pkg.session()
    bad = torch.from_numpy(_ids(20)).cuda()
    bad[0, 3] = VOCAB + 7
    out = sess.run(input_ids=bad)["out"]
    torch.from_dlpack(out)   # a protocol consumer is not a synchronising point
    with pytest.raises(IndexOutOfRangeError, match=r"input 'input_ids'"):
        sess.sync()
    sess.sync()              # reported once
    ids = _ids(20, 3)
    got = sess.run(input_ids=torch.from_numpy(ids).cuda())["out"].numpy()
    np.testing.assert_allclose(got, _eager(model, ids), rtol=1e-5, atol=1e-5)


def test_sessions_have_their_own_error_word(emb):
    _, pkg = emb
    a, b = pkg.session(), pkg.session()
    bad = _ids(10)
    bad[0, 0] = VOCAB
    a.run(input_ids=bad)
    b.run(input_ids=_ids(10))
    b.sync()                 # b saw no bad index
    with pytest.raises(IndexOutOfRangeError):
        a.sync()


def test_data_dependent_shape_is_a_synchronising_point(tmp_path):
    torch.manual_seed(0)
    model = Selected().eval()
    path = grace_compile(model, (torch.randint(0, VOCAB, (3, 8)),), output=tmp_path / "sel.grace",
                         progress=False)
    sess = load(path).session(poison=True)
    ids = np.random.default_rng(5).integers(0, VOCAB, (3, 8)).astype(np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(sess.run(input_ids=ids)["out"].numpy(), ref, rtol=1e-6, atol=1e-6)
    bad = ids.copy()
    bad[2, 2] = 5000         # selected (> 500) and out of range
    out = sess.run(input_ids=bad)["out"]
    with pytest.raises(IndexOutOfRangeError, match=r"input 'input_ids'.*aten\.embedding"):
        out.shape            # reads the data symbol from the device
    np.testing.assert_allclose(sess.run(input_ids=ids)["out"].numpy(), ref, rtol=1e-6, atol=1e-6)
