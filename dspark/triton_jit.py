"""`triton.jit` options shared by the kernels (imported only by modules that import triton).

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
