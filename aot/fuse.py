"""Stage `fuse` (compiler.PIPELINE): epilogue fusion.

Prologue fusion happens during lowering (pointwise expressions are evaluated inside whichever
kernel reads them). What is left are pointwise kernels that read the *result* of an earlier
kernel element for element — a GEMM followed by GELU, a residual add after an output projection,
the copy of a result into a graph output. Such a consumer is folded into the producer's store:
the producer's epilogue becomes the consumer's expression with the producer's value in place of
the load, and the producer writes the consumer's buffer directly.

The pass returns new kernels (the fused producer is a new Kernel) in a new list: the lowered
program's kernels are left as they were, so the `lower` stage's state stays what it printed.
"""
from __future__ import annotations

from dataclasses import replace

from . import families
from .ir import Kernel, Load, Op, identity_load, numel, only_ops_above
from .views import reshape


def _readers(kernels: list[Kernel]) -> dict[int, list[int]]:
    readers: dict[int, list[int]] = {}
    for i, k in enumerate(kernels):
        for buf in k.reads():
            readers.setdefault(buf.index, []).append(i)
    return readers


def substitute(expr, buf, value):
    """`expr` with every load of `buf` (under pointwise ops) replaced by `value`: a new tree,
    `expr` unchanged."""
    return replace_nodes(expr, lambda node: isinstance(node, Load) and node.buf is buf, value)


def replace_nodes(expr, match, value):
    """`expr` with every node for which `match` holds (under pointwise ops) replaced by `value`:
    a new tree, `expr` unchanged."""
    memo = {}

    def go(node):
        if id(node) in memo:
            return memo[id(node)]
        if match(node):
            out = value
        elif isinstance(node, Op):
            out = Op(node.op, [go(a) for a in node.args], node.dtype, node.param)
        else:
            out = node
        memo[id(node)] = out
        return out

    return go(expr)


def fuse_epilogues(kernels: list[Kernel]) -> list[Kernel]:
    """The kernels after epilogue fusion, as a new list (`kernels` and its kernels unchanged)."""
    kernels = list(kernels)
    changed = True
    while changed:
        changed = False
        # a buffer's last writer: one that a scatter writes into after its whole writer is the
        # scatter's (no fusable producer), so its whole writer is never folded away
        producer_of = {k.out.index: i for i, k in enumerate(kernels)}
        readers = _readers(kernels)
        for j, consumer in enumerate(kernels):
            if not families.of(consumer).fusable_consumer:
                continue
            for buf in consumer.reads():
                i = producer_of.get(buf.index)
                if i is None or buf.kind != "arena" or readers.get(buf.index) != [j]:
                    continue
                if consumer.out.dynamic:   # user memory of the true size: stored by its own kernel
                    continue
                producer = kernels[i]
                if not families.of(producer).fusable_producer or producer.spec.writes_partials:
                    continue   # split-K / split-KV partials: their reader applies the epilogue
                if _overwritten_before(kernels, i, j):
                    continue
                if numel(producer.out_shape) != numel(consumer.out_shape):
                    continue
                if not identity_load(consumer.epilogue, consumer.out_shape, buf):
                    continue
                expr = reshape(consumer.epilogue, consumer.out_shape, producer.out_shape)
                # after the reshape the load of `buf` must still be the identity
                if (not identity_load(expr, producer.out_shape, buf)
                        or not only_ops_above(expr, buf)):
                    continue
                fused = replace(producer, epilogue=substitute(expr, buf, producer.epilogue),
                                out=consumer.out, label=_joined(producer.label, consumer.label))
                if families.in_place_problem(fused):
                    continue   # it would read what its own programs overwrite (a state update)
                kernels = kernels[:i] + kernels[i + 1:j] + [fused] + kernels[j + 1:]
                changed = True
                break
            if changed:
                break
    return kernels


def _overwritten_before(kernels: list[Kernel], i: int, j: int) -> bool:
    """A kernel between the producer (i) and its consumer (j) writes a buffer the producer reads:
    fused, the producer runs at the consumer's place, after that write, and would read the new
    value (an update of session state that an earlier state update reads the old value of)."""
    read = {b.index for b in kernels[i].reads()}
    return any(k.out.index in read for k in kernels[i + 1:j])


def _joined(producer: str, consumer: str) -> str:
    """The fused kernel's label: the producer's ops, then the consumer's that are new (each op
    named once: a copy of `mm` adds none)."""
    parts = producer.split("+")
    parts += [p for p in consumer.split("+") if p and p not in parts]
    return "+".join(parts)
