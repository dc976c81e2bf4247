"""Load safetensors checkpoints (single file or sharded with an index) into our modules.

Every parameter must be written exactly once (packed parameters: each shard once); a missing
tensor, a shape mismatch, an unreadable file or an unexpected tensor raises an error that names
it. Tensors a model declares as optional (e.g. a drafter's copy of the target's embedding) are
skipped or compared through the `ignore` callback.

A parameter whose module has a `weight_loader(param, tensor, shard_id)` (the tensor-parallel
layers of dspark/layers/parallel.py) receives the full checkpoint tensor and copies its own
rank's slice; the others are copied whole (or part by part for packed parameters).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"shard {name!r} listed in {index} is missing")
        return [os.path.join(path, n) for n in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights found in {path!r}")
    return [os.path.join(path, f) for f in found]


def iter_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    for file in checkpoint_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"cannot read weight file {file!r}: {e}") from None


def load_weights(
    model: nn.Module,
    path: str,
    name_to_param: Callable[[str], str],
    packed: dict[str, tuple[str, int]],
    shard_sizes: Callable[[str], list[int] | None],
    ignore: Callable[[str, torch.Tensor], bool] = lambda name, t: False,
) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - {
        n for n, p in model.named_parameters()
    }
    modules = dict(model.named_modules())
    written: dict[str, set[int]] = {}
    for ckpt_name, tensor in iter_tensors(path):
        if ignore(ckpt_name, tensor):
            continue
        name = name_to_param(ckpt_name)
        shard = None
        for frag, (target, idx) in packed.items():
            if f".{frag}." in f".{name}":
                name, shard = name.replace(frag, target), idx
                break
        if name not in params:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"unexpected tensor {ckpt_name!r} in checkpoint {path!r}")
        param = params[name]
        owner = modules.get(name.rpartition(".")[0])
        weight_loader = getattr(owner, "weight_loader", None)
        with torch.no_grad():
            if weight_loader is not None:
                try:
                    weight_loader(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"tensor {ckpt_name!r} {e}") from None
                parts = range(len(shard_sizes(name) or [0])) if shard is None else [shard]
                written.setdefault(name, set()).update(parts)
            elif shard is None:
                _check_shape(ckpt_name, tensor.shape, param.shape)
                param.copy_(tensor)
                written.setdefault(name, set()).add(0)
            else:
                sizes = shard_sizes(name)
                offset = sum(sizes[:shard])
                dst = param.narrow(0, offset, sizes[shard])
                _check_shape(ckpt_name, tensor.shape, dst.shape)
                dst.copy_(tensor)
                written.setdefault(name, set()).add(shard)
    for name in params:
        if name in tied:
            continue
        sizes = shard_sizes(name)
        need = set(range(len(sizes))) if sizes else {0}
        if not need <= written.get(name, set()):
            raise ValueError(f"checkpoint {path!r} is missing tensor(s) for parameter {name!r}")


def _check_shape(name, got, want):
    if tuple(got) != tuple(want):
        raise ValueError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(want)}")
