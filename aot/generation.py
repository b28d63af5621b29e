"""`--generate`: what a causal LM needs so the runtime can decode greedily on the device.

The user names the export's token and position inputs (`forward(idx [1, T], input_pos [T])`, the
gpt-fast / transformers static-cache pattern). This stage checks that contract, makes T = 1 (a
decode step) a bucket of its own, adds the generation's state buffers (ctrl words, the generated
ids, the next token and position that the decode graph reads as its inputs) and builds the step
kernel (argmax + advance, codegen.generate_step_source). The runtime then runs prefill, and the
decode steps inside one CUDA graph WHILE loop (docs/design-state.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from .codegen import KernelSource, generate_step_source
from .ir import Program, with_zero_state
from .lower import LoweringError

# the generation's state entries (a model with a buffer of one of these names is refused)
CTRL, OUT_TOKENS, NEXT_TOKEN, NEXT_POSITION = ("generate.ctrl", "generate.out_tokens",
                                               "generate.next_token", "generate.next_position")
# where the step's programs meet (codegen.generate_step_source): zero between steps
STEP_SCRATCH = "generate.step_scratch"


@dataclass
class GenerationPlan:
    source: KernelSource          # the step kernel; its buffers are graph 0's
    tokens: str
    positions: str
    logits: str
    capacity: int
    decode_graph: int


def _user_inputs(core) -> list[str]:
    from torch.export.graph_signature import InputKind
    return [s.arg.name for s in core.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]


def _decode_symbol(core, symbols, spec):
    """The size symbol of the tokens' dim 1 (T), checked to be the positions' dim 0 too."""
    names = _user_inputs(core)
    for key in ("tokens", "positions"):
        if spec[key] not in names:
            raise LoweringError(f"--generate {key}={spec[key]}: the program has no input of that "
                                f"name (its inputs: {', '.join(names)})")
    others = [n for n in names if n not in (spec["tokens"], spec["positions"])]
    if others:
        raise LoweringError(f"--generate: the program has inputs besides tokens and positions "
                            f"({', '.join(others)}); generate() could not fill them")
    ti, pi = names.index(spec["tokens"]), names.index(spec["positions"])
    for s in symbols:
        if s.kind == "input" and (ti, 1) in s.sources:
            if (pi, 0) not in s.sources:
                raise LoweringError("--generate: the positions input's dim 0 must be the same "
                                    "dynamic dimension as the tokens' dim 1 (T)")
            return s
    raise LoweringError(f"--generate: input {spec['tokens']!r} must be [1, T] with a dynamic T "
                        "(export with dynamic_shapes, T from 1 to the cache length)")


def add_decode_bucket(core, symbols, lists: dict, spec: dict) -> None:
    """T = 1 gets its own graph: decode must not pay for a prompt-sized bucket."""
    sym = _decode_symbol(core, symbols, spec)
    if sym.lo > 1:
        raise LoweringError(f"--generate: the dynamic dimension {sym.name} must allow 1 (a decode "
                            f"step), but its minimum is {sym.lo}")
    lists[sym.name] = sorted({1, *lists[sym.name]})


def add_state(program: Program, spec: dict) -> Program:
    """The lowered program with the generation's state buffers after its own (every graph gets
    the same ones, so they have the same offsets in each), numbered from its next index."""
    taken = {b.name for b in program.state}
    if taken & {CTRL, OUT_TOKENS, NEXT_TOKEN, NEXT_POSITION, STEP_SCRATCH}:
        raise LoweringError("the model has a buffer named generate.*, which --generate uses")
    capacity = _capacity(program, spec)
    shapes = ((CTRL, (4,)), (OUT_TOKENS, (capacity,)), (NEXT_TOKEN, (1, 1)), (NEXT_POSITION, (1,)),
              (STEP_SCRATCH, (2,)))
    return with_zero_state(program, [(name, "int64", shape) for name, shape in shapes])


def _capacity(program, spec: dict) -> int:
    if "capacity" in spec:
        capacity = int(spec["capacity"])
        if capacity < 1:
            raise LoweringError(f"--generate capacity={capacity}: must be at least 1")
        return capacity
    sizes = [size for name, size in program.state_index_sizes if name == spec["positions"]]
    if not sizes:
        raise LoweringError(f"--generate: input {spec['positions']!r} does not index any mutated "
                            "buffer (a KV cache written at the positions); give capacity=N")
    return min(sizes)


def plan(graphs, symbols, spec: dict) -> GenerationPlan:
    """Check the logits output on the last graph, the largest bucket's (at the decode bucket T is
    pinned to 1, so the logits are static there), and build the step kernel over graph 0's
    buffers (whose memory plan manifest.py maps them with; it reads T from the logits' slot at
    run time, and rank and vocabulary are the same in every graph)."""
    program = graphs[-1].program
    outputs = {b.name: b for b in program.outputs}
    logits_name = spec.get("logits") or program.outputs[0].name
    if logits_name not in outputs:
        raise LoweringError(f"--generate logits={logits_name}: no output of that name (outputs: "
                            f"{', '.join(outputs)})")
    logits = outputs[logits_name]
    inputs = {b.name: b for b in program.inputs}
    tokens, positions = inputs[spec["tokens"]], inputs[spec["positions"]]
    if tokens.dtype != "int64" or len(tokens.shape) != 2 or tokens.shape[0] != 1:
        raise LoweringError(f"--generate: tokens {tokens.name!r} must be int64 [1, T], not "
                            f"{tokens.dtype}{list(tokens.shape)}")
    if positions.dtype != "int64" or len(positions.shape) != 1:
        raise LoweringError(f"--generate: positions {positions.name!r} must be int64 [T], not "
                            f"{positions.dtype}{list(positions.shape)}")
    if (logits.dtype not in ("float32", "float16", "bfloat16") or len(logits.shape) < 2
            or any(d != 1 for d in logits.shape[:-2]) or not logits.dynamic
            or not logits.dynamic[-2] or logits.dynamic[-1]):
        raise LoweringError(f"--generate: logits {logits.name!r} must be a float [1, T, vocab] "
                            f"output, not {logits.dtype}{list(logits.shape)}")
    sym = _decode_symbol_of(graphs, symbols, spec)
    decode = next(i for i, g in enumerate(graphs) if g.bucket[sym] == 1)
    first = graphs[0].program
    state = {b.name: b for b in first.state}
    capacity = state[OUT_TOKENS].shape[0]
    source = generate_step_source({b.name: b for b in first.outputs}[logits_name],
                                  {b.name: b for b in first.inputs}[spec["positions"]],
                                  state[CTRL], state[OUT_TOKENS], state[NEXT_TOKEN],
                                  state[NEXT_POSITION], state[STEP_SCRATCH])
    return GenerationPlan(source, tokens.name, positions.name, logits_name, capacity, decode)


def _decode_symbol_of(graphs, symbols, spec) -> str:
    names = [b.name for b in graphs[0].program.inputs]
    ti = names.index(spec["tokens"])
    return next(s.name for s in symbols if s.kind == "input" and (ti, 1) in s.sources)
