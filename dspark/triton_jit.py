"""`triton.jit` options and grid sizing shared by the kernels (imported only with triton).

Triton compiles one variant of a kernel per specialisation of its arguments: an integer equal
to 1 or divisible by 16, a pointer aligned to 16 bytes. For arguments that vary from step to
step (token and request counts, views into a packed step buffer) every new combination is a
compile (~0.3-1 s) in the middle of serving. Newer Triton versions split the switch in two
(`do_not_specialize` for values, `do_not_specialize_on_alignment` for divisibility); both are
set where the installed Triton has them.
"""

from __future__ import annotations

import inspect

import triton

_HAS_ALIGNMENT_SWITCH = "do_not_specialize_on_alignment" in inspect.signature(
    triton.jit).parameters  # fmt: skip


def unspecialized(*names: str) -> dict:
    """`triton.jit` keyword arguments that compile one variant whatever `names` hold."""
    opts = {"do_not_specialize": list(names)}
    if _HAS_ALIGNMENT_SWITCH:
        opts["do_not_specialize_on_alignment"] = list(names)
    return opts


# (row, chunk) grids over a vocabulary: enough programs in flight for a memory-bound pass
_TARGET_PROGRAMS = 528  # ~4 per SM on an H200
_MAX_CHUNKS = 64


def vocab_chunks(rows: int, vocab: int, block: int) -> tuple[int, int, int]:
    """(block, chunk, num_chunks) for kernels that split each of `rows` rows of `vocab`
    columns into chunks of whole `block`-column loads, one program per (row, chunk): about
    _TARGET_PROGRAMS programs in all, at most _MAX_CHUNKS per row."""
    block = min(block, triton.next_power_of_2(vocab))
    want = max(1, -(-_TARGET_PROGRAMS // max(rows, 1)))
    num_chunks = max(1, min(want, triton.cdiv(vocab, block), _MAX_CHUNKS))
    chunk = triton.cdiv(triton.cdiv(vocab, num_chunks), block) * block
    return block, chunk, triton.cdiv(vocab, chunk)
