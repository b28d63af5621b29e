"""The generation step's argmax (codegen.generate_step_source) against numpy's, through the CPU
reference executor: a vocabulary of several lane blocks with a ragged last one, ties (the first
maximum wins, as torch and numpy), a maximum in the last block, and a row of -inf (column 0).

The model is a toy LM whose logits for token t peak around a column it computes from t, so a
greedy generation walks a chain of argmaxes that numpy can predict."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.export import Dim  # noqa: E402

from grace.aot import codegen  # noqa: E402
from grace.aot import compile as grace_compile  # noqa: E402
from grace.tools.interpret import InterpretSession  # noqa: E402

pytestmark = pytest.mark.slow
CAP = 16
DEAD = 5   # the token whose logits are all -inf


class ArgmaxLM(torch.nn.Module):
    """logits[v] = -floor(|v - target(t)| / 2): the maximum 0 at target - 1, target and
    target + 1 (a three-way tie; the first wins), -inf everywhere for token DEAD. A KV-cache-like
    state records the tokens, as generation needs one."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.register_buffer("seen", torch.zeros(CAP))

    def forward(self, idx, input_pos):
        self.seen[input_pos] = idx[0].float()
        cols = torch.arange(self.vocab, dtype=torch.float32)
        target = ((idx * 7919 + 13) % self.vocab).float()[..., None]
        logits = -torch.floor((cols - target).abs() / 2) + 0 * self.seen.sum()
        return torch.where(idx[..., None] == DEAD, float("-inf"), logits)


def expected_chain(vocab, last, n):
    out = []
    for _ in range(n):
        if last == DEAD:
            row = np.full(vocab, -np.inf)
        else:
            target = (last * 7919 + 13) % vocab
            row = -np.floor(np.abs(np.arange(vocab) - target) / 2)
        last = int(np.argmax(row))
        out.append(last)
    return out


def _session(model, tmp_path) -> InterpretSession:
    """`model` compiled for generate() (tokens [1, T], positions [T]), on the CPU executor."""
    t = Dim("seq", min=1, max=CAP)
    path = grace_compile(model.eval(), (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                         output=tmp_path / "lm.grace", progress=False,
                         dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                         generate={"tokens": "idx", "positions": "input_pos"})
    return InterpretSession(path)


@pytest.mark.parametrize("vocab", [100, 3 * codegen.GENERATE_STEP_BLOCK + 77])
def test_generate_step_argmax_matches_numpy(tmp_path, vocab):
    sess = _session(ArgmaxLM(vocab), tmp_path)
    # a token whose maximum lies in the last, ragged block
    late = next(t for t in range(1, vocab) if t != DEAD
                and (t * 7919 + 13) % vocab >= vocab - 77 + 1)
    # a prompt ending in DEAD: the first token comes from an all -inf row
    for prompt in ([3, 9, DEAD], [11, 2], [late]):
        got = sess.generate(np.array(prompt, np.int64), 6)
        assert list(got) == expected_chain(vocab, prompt[-1], 6), (vocab, prompt)


class TableLM(torch.nn.Module):
    """The logits after token t are row t of a table: each row a designed argmax case."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)
        self.register_buffer("seen", torch.zeros(CAP))

    def forward(self, idx, input_pos):
        self.seen[input_pos] = idx[0].float()
        return self.table[idx] + 0 * self.seen.sum()


def _designed_rows(vocab, block):
    """(row, expected column): the cases where the step's programs must agree on torch's answer."""
    inf, cases = float("inf"), []

    def row(fill=-1.0, **at):
        r = torch.full((vocab,), fill)
        for col, v in at.items():
            r[int(col[1:])] = v
        return r
    # a tie across a program boundary and a third copy later: the first wins
    cases.append((row(**{f"c{block - 1}": 5.0, f"c{block}": 5.0, f"c{vocab - 3}": 5.0}), block - 1))
    # -0.0 in the first program, +0.0 in a later one: equal, so the first
    cases.append((row(**{"c10": -0.0, f"c{2 * block + 1}": 0.0}), 10))
    cases.append((row(-inf), 0))                                             # all -inf: column 0
    cases.append((row(-3e38, **{f"c{vocab - 1}": -1e38}), vocab - 1))      # the ragged end
    cases.append((row(0.0, **{f"c{block + 7}": 1e-37}), block + 7))        # tiny but largest
    cases.append((row(-inf, c3=float("nan"), **{f"c{vocab - 2}": 1.0}), vocab - 2))  # NaN never wins
    cases.append((row(-2.0, c0=-1.5), 0))                                    # all negative
    cases.append((row(3e38, **{f"c{2 * block}": inf}), 2 * block))          # +inf beats huge
    return cases


@pytest.mark.parametrize("programs", [1, 2, 64])
def test_generate_step_programs_agree_on_the_first_maximum(tmp_path, monkeypatch, programs):
    """The step's programs fold their bests into one key (value, then smaller column) with an
    atomic max, the last to arrive advances: across program boundaries the answer is torch's
    argmax (NaN aside), with one program walking several rounds, two, and one round each."""
    monkeypatch.setattr(codegen, "GENERATE_STEP_PROGRAMS", programs)
    block = codegen.GENERATE_STEP_BLOCK
    vocab = 3 * block + 77
    cases = _designed_rows(vocab, block)
    table = torch.stack([r for r, _ in cases])
    sess = _session(TableLM(table), tmp_path)
    for i, (r, want) in enumerate(cases):
        if not torch.isnan(r).any():
            assert int(torch.argmax(r)) == want   # the case says what torch says
        got = sess.generate(np.array([i], np.int64), 1)
        assert list(got) == [want], (i, programs)
    # the meeting words are back at zero after every step
    assert not sess.read_state()["generate.step_scratch"].any()


@pytest.mark.parametrize("rows,want", [
    ([[1.5]], [0]),                                  # a vocabulary of one: column 0
    ([[-0.0, 0.0], [float("-inf")] * 2], [0, 0]),   # two: a ±0 tie, all -inf (token ids < 2)
    ([[-1.0, 2.0], [3.0, float("nan")]], [1, 0]),    # the second wins; NaN never does
])
def test_generate_step_tiny_vocabularies(tmp_path, rows, want):
    """Vocabularies of one and two logits: one program, a one- or two-lane block."""
    table = torch.tensor(rows)
    sess = _session(TableLM(table), tmp_path)
    for i, w in enumerate(want):
        if not torch.isnan(table[i]).any():   # torch's argmax picks NaN; the step never does
            assert int(torch.argmax(table[i])) == w
        assert list(sess.generate(np.array([i], np.int64), 1)) == [w]
