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


@pytest.mark.parametrize("vocab", [100, 3 * codegen.GENERATE_STEP_BLOCK + 77])
def test_generate_step_argmax_matches_numpy(tmp_path, vocab):
    t = Dim("seq", min=1, max=CAP)
    path = grace_compile(ArgmaxLM(vocab).eval(),
                         (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                         output=tmp_path / "lm.grace", progress=False,
                         dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                         generate={"tokens": "idx", "positions": "input_pos"})
    sess = InterpretSession(path)
    # a token whose maximum lies in the last, ragged block
    late = next(t for t in range(1, vocab) if t != DEAD
                and (t * 7919 + 13) % vocab >= vocab - 77 + 1)
    # a prompt ending in DEAD: the first token comes from an all -inf row
    for prompt in ([3, 9, DEAD], [11, 2], [late]):
        got = sess.generate(np.array(prompt, np.int64), 6)
        assert list(got) == expected_chain(vocab, prompt[-1], 6), (vocab, prompt)
