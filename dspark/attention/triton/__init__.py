"""Triton kernels of the `triton` attention backend (`dspark.attention.triton_backend`).

Modules: `kv_write` (KV scatter by slot), `paged_attention` (ragged target attention,
flash-decoding splits, split combine), `draft_attention` (the drafter's block attention).
Import the modules, not names from this package: the functions share the modules' names.

Importing a module imports `triton` and JIT-decorates its kernels. Whether they run compiled
(CUDA) or through Triton's CPU interpreter is fixed when they are decorated, i.e. on first
import: set `TRITON_INTERPRET=1` before that (and before importing `triton`) to run them on
CPU tensors.
"""
