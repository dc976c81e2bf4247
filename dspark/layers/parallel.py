"""Tensor-parallel layers (Megatron style) that are plain torch layers at world size 1.

    ColumnParallelLinear        W [out, in] split by output rows; y_r = x W_r^T (no collective)
    MergedColumnParallelLinear  [gate; up]: each part split by rows; rank r holds [gate_r; up_r]
    QKVParallelLinear           [q; k; v] split by heads: H/N query and Hkv/N kv heads per rank
    RowParallelLinear           W split by input columns; y = all_reduce(x_r W_r^T) + b
    VocabParallelEmbedding      rows [r*Vp, (r+1)*Vp) of the table (Vp = ceil(V/N), the last
                                shard zero-padded); ids of other shards look up zeros; all_reduce
    ParallelLMHead              logits_r = h W_r^T [.., Vp]; all_gather -> full vocab [.., V]

Layers capture the tensor-parallel group at construction from `tensor_parallel(group)`; built
outside that context (the default) they have one rank, no process group and the forward of
nn.Linear / nn.Embedding. Parameter names and full-size shapes at one rank are those of the
plain layers, so checkpoints, training code and state dicts are unchanged. With more than one
rank they are for inference (the collectives carry no autograd).

Loading: `weight_loader(param, tensor, shard_id)` takes the *unsharded* checkpoint tensor (or
one part of a merged projection, `shard_id`) and copies this rank's slice; a shape mismatch
raises ValueError("has shape X, expected Y") with the full-size shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """One rank's place in a tensor-parallel group (`group`: the device ProcessGroup)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[M, ...] on every rank -> [size * M, ...], rank-major."""
        import torch.distributed as dist

        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.group)
        return out


SINGLE = TPGroup()
_current = SINGLE


@contextmanager
def tensor_parallel(group: TPGroup) -> Iterator[TPGroup]:
    """Layers constructed inside this context are sharded over `group`."""
    global _current
    prev, _current = _current, group
    try:
        yield group
    finally:
        _current = prev


def current_group() -> TPGroup:
    return _current


def divide(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(
            f"tensor_parallel_size={size} must divide {what} ({n}); pick a tensor-parallel "
            "size that divides the number of attention heads, kv heads and the MLP width"
        )
    return n // size


def _shape_error(got, want) -> ValueError:
    return ValueError(f"has shape {tuple(got)}, expected {tuple(want)}")


class ColumnParallelLinear(nn.Linear):
    """Output features split across ranks; `output_sizes` > 1 parts are split part by part."""

    def __init__(self, in_features: int, output_sizes: int | list[int], bias: bool = True,
                 what: str = "the output features"):  # fmt: skip
        tp = current_group()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.output_sizes = sizes  # full size of each part
        self.local_sizes = [divide(s, tp.size, what) for s in sizes]
        super().__init__(in_features, sum(self.local_sizes), bias=bias)
        self.tp = tp

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None):
        parts = range(len(self.output_sizes)) if shard_id is None else [shard_id]
        want = (sum(self.output_sizes[i] for i in parts), *param.shape[1:])
        if tuple(loaded.shape) != want:
            raise _shape_error(loaded.shape, want)
        src_off = 0
        for i in parts:
            n = self.local_sizes[i]
            dst = param.narrow(0, sum(self.local_sizes[:i]), n)
            dst.copy_(loaded.narrow(0, src_off + self.tp.rank * n, n))
            src_off += self.output_sizes[i]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Packed projections such as [gate; up] of a SwiGLU MLP."""


class QKVParallelLinear(ColumnParallelLinear):
    """Packed [q; k; v]; each rank holds whole heads: num_heads / N and num_kv_heads / N."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):  # fmt: skip
        size = current_group().size
        self.num_heads = divide(num_heads, size, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads, size, "num_key_value_heads")
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q, kv, kv], bias=bias)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim  # this rank's
        self.kv_size = self.num_kv_heads * head_dim


class RowParallelLinear(nn.Linear):
    """Input features split across ranks; partial products summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 what: str = "the input features"):  # fmt: skip
        tp = current_group()
        super().__init__(divide(in_features, tp.size, what), out_features, bias=bias)
        self.full_in_features = in_features
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None):
        if param.dim() == 1:  # bias: replicated, added once after the reduction
            if loaded.shape != param.shape:
                raise _shape_error(loaded.shape, param.shape)
            param.copy_(loaded)
            return
        want = (param.shape[0], self.full_in_features)
        if tuple(loaded.shape) != want:
            raise _shape_error(loaded.shape, want)
        n = param.shape[1]
        param.copy_(loaded.narrow(1, self.tp.rank * n, n))


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        tp = current_group()
        per_rank = -(-num_embeddings // tp.size)
        super().__init__(per_rank, embedding_dim)
        self.tp = tp
        self.org_vocab_size = num_embeddings
        self.vocab_start = tp.rank * per_rank
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows [Vp, d] of a full [V, d] table (zero padded)."""
        out = full.new_zeros((self.num_embeddings, *full.shape[1:]))
        n = self.vocab_end - self.vocab_start
        out[:n] = full[self.vocab_start : self.vocab_end]
        return out

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None):
        want = (self.org_vocab_size, param.shape[1])
        if tuple(loaded.shape) != want:
            raise _shape_error(loaded.shape, want)
        param.copy_(self.shard_of(loaded.to(param.dtype)))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over a vocab-parallel table (may be tied to the embedding's weight).

    Every rank gets the full-vocabulary logits: sampling, verification and the drafter run
    replicated on every rank from identical inputs."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., V]
        if self.tp.size == 1:
            return F.linear(hidden, self.weight)
        lead = hidden.shape[:-1]
        local = F.linear(hidden.reshape(-1, hidden.shape[-1]), self.weight)  # [M, Vp]
        m, vp = local.shape
        full = self.tp.all_gather(local).view(self.tp.size, m, vp).permute(1, 0, 2)
        logits = full.reshape(m, self.tp.size * vp)[:, : self.org_vocab_size]
        return logits.reshape(*lead, self.org_vocab_size)
