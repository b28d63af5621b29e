"""generate(): what the runtime needs to drive a causal LM package (docs/design-state.md).

    GeneratePlan(view, state_entries)       pure; run by load() for a package with a `generate` map
                                            (grace.formats has checked it): the inputs, output and
                                            state entries it names, and the step node planned like
                                            a graph node (graph.plan_node).
    plan.check(prompt, max_new, eos)        the generate() arguments -> (prompt int64 [P], ctrl
                                            int64[4]), InputError naming the limit before anything
                                            runs.
    SET_CONDITION_PTX                       the runtime's own kernel: cudaGraphSetConditional(handle,
                                            ctrl[3] == 0), i.e. "loop again while not done".

The set_condition kernel is PTX text, not a cubin, because it belongs to the runtime and not to a
package: the driver JIT-compiles it for whatever GPU the session runs on (cuModuleLoadData accepts
PTX), and cudaGraphSetConditional is a device builtin that ptxas resolves without a device runtime
library. `.version 8.0` (CUDA 12.0) is accepted by every driver that has conditional nodes.
"""

from __future__ import annotations

import numpy as np

from grace.formats.view import as_view

from .errors import GraceRuntimeError, InputError, InvalidPackageError
from .graph import plan_node

SET_CONDITION_NAME = "grace_set_condition"

# From nvcc 13.0: extern "C" __global__ void grace_set_condition(cudaGraphConditionalHandle h,
# const long long* ctrl) { cudaGraphSetConditional(h, ctrl[3] == 0 ? 1u : 0u); }
SET_CONDITION_PTX = """\
.version 8.0
.target sm_80
.address_size 64
.extern .func cudaGraphSetConditional ( .param .b64 p0, .param .b32 p1 );
.visible .entry grace_set_condition( .param .u64 h, .param .u64 ctrl ) {
  .reg .pred %p<2>; .reg .b32 %r<2>; .reg .b64 %rd<5>;
  ld.param.u64 %rd1, [h]; ld.param.u64 %rd2, [ctrl]; cvta.to.global.u64 %rd3, %rd2;
  ld.global.u64 %rd4, [%rd3+24]; setp.eq.s64 %p1, %rd4, 0; selp.u32 %r1, 1, 0, %p1;
  { .param .b64 param0; st.param.b64 [param0+0], %rd1; .param .b32 param1; st.param.b32 [param1+0], %r1;
    call.uni cudaGraphSetConditional, (param0, param1); }
  ret; }
"""

NOT_GENERATE = ("this package was not compiled with --generate (its manifest has no 'generate' map); "
                "compile it with `grace compile ... --generate tokens=NAME,positions=NAME` or use run()")

# ctrl words (int64[4], state entry generate.ctrl)
COUNT, LIMIT, EOS, DONE = range(4)


class GeneratePlan:
    """The `generate` map, for the runtime. Attributes: `tokens`, `positions` (input indices),
    `capacity`, `decode_graph`, `step` (NodePlan), `ctrl`, `out_tokens`, `next_token`,
    `next_position` (StateEntry), `prompt_limit` ((lo, hi, what) for P), `vocab` (the logits' last
    dim or None). `manifest`: a formats.view.Manifest, or a manifest dict (validated first);
    `state_entries`: its state.StateEntry list."""

    def __init__(self, manifest, state_entries):
        m = as_view(manifest)
        gen = m.generate
        inputs = [t.name for t in m.inputs]
        if sorted(inputs) != sorted([gen.tokens, gen.positions]):   # all generate() can feed
            raise InvalidPackageError(f"generate: the package's inputs are {inputs}, but generate() feeds "
                                      f"exactly tokens={gen.tokens!r} and positions={gen.positions!r}")
        self.tokens, self.positions = inputs.index(gen.tokens), inputs.index(gen.positions)
        self._specs = m.inputs
        logits = next(t for t in m.outputs if t.name == gen.logits).shape
        self.vocab = logits[-1] if logits and isinstance(logits[-1], int) else None
        self.capacity = gen.capacity
        self.decode_graph = gen.decode_graph
        self.step = plan_node(m.kernels, gen.step, 0, f"generate step ({gen.step.label or '?'})")
        by_name = {e.name: e for e in state_entries}
        self.ctrl, self.out_tokens = by_name[gen.ctrl], by_name[gen.out_tokens]
        self.next_token, self.next_position = by_name[gen.next_token], by_name[gen.next_position]
        self.prompt_limit = self._prompt_limit(m.symbols)

    def _prompt_limit(self, symbols):
        """(lo, hi, what): the prompt lengths the tokens input's last dim allows."""
        spec = self._specs[self.tokens]
        dim = spec.shape[-1]
        if isinstance(dim, int):
            return dim, dim, f"input {spec.name!r} has a static length of {dim}"
        symbol = next(s for s in symbols if s.name == dim)
        return (symbol.min, symbol.max,
                f"symbol {dim!r} (the length of input {spec.name!r}) is in [{symbol.min}, {symbol.max}]")

    # ------------------------------------------------------------------------------ per call
    def input_shapes(self, length: int) -> list:
        """The input shapes of a run over `length` tokens, in manifest order: tokens and positions with
        `length` in their last dim and 1 in any leading dim ([1, P] and [P] for the usual LM)."""
        shapes = [None] * len(self._specs)
        for i in (self.tokens, self.positions):
            shapes[i] = (1,) * (len(self._specs[i].shape) - 1) + (length,)
        return shapes

    def prefill_inputs(self, prompt: np.ndarray) -> dict:
        """{input name: numpy array} of the prefill run: the prompt and positions 0..P-1."""
        shapes = self.input_shapes(len(prompt))
        tokens, positions = self._specs[self.tokens], self._specs[self.positions]
        return {tokens.name: prompt.astype(tokens.dtype).reshape(shapes[self.tokens]),
                positions.name: np.arange(len(prompt), dtype=positions.dtype).reshape(shapes[self.positions])}

    def check(self, prompt_ids, max_new_tokens, eos_token_id) -> tuple:
        """(prompt as int64 [P], ctrl int64[4]) or InputError, before anything is enqueued."""
        prompt = _prompt_array(prompt_ids)
        n = len(prompt)
        lo, hi, what = self.prompt_limit
        if not lo <= n <= hi:
            raise InputError(f"generate: the prompt has {n} tokens, but {what}")
        if self.vocab is not None and (prompt.min() < 0 or prompt.max() >= self.vocab):
            raise InputError(f"generate: prompt token ids must be in [0, {self.vocab}) (the logits' size), "
                             f"got [{prompt.min()}, {prompt.max()}]")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise InputError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        max_new = int(max_new_tokens)
        if n + max_new - 1 > self.capacity:
            raise InputError(f"generate: the prompt ({n} tokens) + max_new_tokens ({max_new}) - 1 = "
                             f"{n + max_new - 1} exceeds the cache capacity of {self.capacity} positions; "
                             f"at most {self.capacity - n + 1} new tokens fit after this prompt")
        if eos_token_id is not None and (isinstance(eos_token_id, bool)
                                         or not isinstance(eos_token_id, (int, np.integer)) or eos_token_id < 0):
            raise InputError(f"generate: eos_token_id must be None or an int >= 0, got {eos_token_id!r}")
        eos = -1 if eos_token_id is None else int(eos_token_id)
        return prompt, np.array([0, max_new, eos, 0], dtype=np.int64)


def _prompt_array(prompt_ids) -> np.ndarray:
    """The prompt as a 1-D int64 array: from a 1-D or [1, P] sequence of ints."""
    try:
        a = np.asarray(prompt_ids)
    except Exception as e:  # a CUDA tensor, an object numpy cannot read
        raise InputError(f"generate: prompt_ids must be a host array of ints (numpy, a list), got "
                         f"{type(prompt_ids).__name__} ({e})") from None
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1:
        raise InputError(f"generate: prompt_ids must be 1-D or [1, P], got shape {list(a.shape)}")
    if a.size == 0:
        raise InputError("generate: the prompt is empty; give at least one token")
    if a.dtype.kind not in "iu":
        raise InputError(f"generate: prompt_ids must be integers, got {a.dtype}")
    return a.astype(np.int64)


def require(plan) -> GeneratePlan:
    """The package's GeneratePlan, or the error that says how to get one."""
    if plan is None:
        raise GraceRuntimeError(NOT_GENERATE)
    return plan
