"""The drafter's fused context write (every layer's k/v in one GEMM and one kernel) against
the per-layer torch path it replaces.

Kernel level: from the same projected keys and values, `write_context_kv` must write what
per-layer k_norm + RoPE + index_copy write (fp32 to rounding noise; bf16 / fp16 bitwise but
for rare last-bit flips from the order of the sum of squares), skip padding tokens (sentinel
or negative slot) and touch no other slot. Drafter level: `write_context` through the fused
path equals the per-layer path, and a weight edited in place after a fused write is seen by
the next one (the stacked weight copy is rebuilt). On CPU the kernels run in Triton's
interpreter at small sizes; on CUDA the same cases run compiled, plus the Qwen3-8B drafter's
head shape.
"""

import pytest
import torch

from tests.kernels import triton_env as env  # first: it sets TRITON_INTERPRET on CPU

DEVICE, ops = env.DEVICE, env.ops

from dspark.attention.base import SENTINEL_SLOT  # noqa: E402
from dspark.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from dspark.attention.triton.context_write import write_context_kv  # noqa: E402
from dspark.layers.norm import RMSNorm  # noqa: E402
from dspark.layers.rotary import RotaryEmbedding  # noqa: E402
from dspark.models.drafter_context import LayerKVCaches  # noqa: E402
from dspark.models.dspark_drafter import DSparkDrafter  # noqa: E402
from tests.kernels.test_fused_ops import check, fused_path, rand, torch_path  # noqa: E402

PAGE, BLOCKS = 4, 12


def slot_mapping(num_tokens: int, gen: torch.Generator, negative: bool = True) -> torch.Tensor:
    """Distinct slots outside block 0 in random order, with padding tokens mixed in (the
    sentinel; a negative slot too unless the torch reference, which cannot take one, runs)."""
    slots = torch.randperm((BLOCKS - 1) * PAGE, generator=gen)[:num_tokens] + PAGE
    if num_tokens >= 3:
        slots[1] = SENTINEL_SLOT
        slots[-1] = -1 if negative else slots[-1]
    return slots.to(DEVICE)


def filled_caches(layers, kv_heads, head_dim, dtype):
    shape = (layers, BLOCKS, PAGE, kv_heads, head_dim)
    return rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layers, kv_heads, head_dim, tokens", [
    (3, 2, 16, 7), (1, 1, 8, 1), (2, 3, 24, 5), (5, 8, 128, 3)])  # fmt: skip
@torch.no_grad()
def test_write_context_kv_matches_per_layer_reference(dtype, layers, kv_heads, head_dim, tokens):
    gen = torch.Generator().manual_seed(layers * 100 + tokens)
    kv = rand(tokens, layers, 2, kv_heads, head_dim, dtype=dtype, scale=2.0)
    positions = torch.tensor([3, 0, 4095, 17, 65537, 9, 1][:tokens], device=DEVICE)
    slots = slot_mapping(tokens, gen)
    rotary = RotaryEmbedding(head_dim, {"rope_theta": 1_000_000.0}).to(DEVICE)
    norms = []
    for _ in range(layers):
        norm = RMSNorm(head_dim, 1e-6).to(DEVICE)
        norm.weight.copy_(rand(head_dim, scale=0.3) + 1.0)
        norms.append(norm.to(dtype))
    k_cache, v_cache = filled_caches(layers, kv_heads, head_dim, dtype)
    orig_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_k = orig_k.clone()
    real = slots > 0  # the reference writes only real tokens; padding must leave no trace
    with torch_path():
        for i in range(layers):
            k = rotary.apply_one(positions, norms[i](kv[:, i, 0]))
            ref_k[i].view(-1, kv_heads, head_dim)[slots[real]] = k[real]
            ref_v[i].view(-1, kv_heads, head_dim)[slots[real]] = kv[real, i, 1]
    weights = torch.stack([n.weight for n in norms])
    write_context_kv(kv, positions, slots, weights, 1e-6, rotary.inv_freq.float(),
                     k_cache, v_cache)  # fmt: skip
    assert torch.equal(v_cache, ref_v)  # copied, not computed
    check(k_cache, ref_k)
    untouched = torch.ones(BLOCKS * PAGE, dtype=torch.bool, device=DEVICE)
    untouched[slots[real]] = False
    rows = k_cache.view(layers, -1, kv_heads, head_dim)
    assert torch.equal(rows[:, untouched], orig_k.view_as(rows)[:, untouched])
    assert not torch.equal(rows[:, ~untouched], orig_k.view_as(rows)[:, ~untouched])


# ------------------------------------------------------------------ through the drafter


def drafter_pair(tmp_path, num_layers=3):
    from dspark.testing.checkpoints import TinyShape, make_tiny_target
    from dspark.testing.drafters import make_tiny_drafter
    from tests.unit.test_drafter import load_target

    tdir = make_tiny_target(str(tmp_path / "t"), TinyShape(num_hidden_layers=4), seed=1)
    ddir = make_tiny_drafter(str(tmp_path / "d"), tdir, num_layers=num_layers, seed=3)
    target = load_target(tdir).to(DEVICE)
    return DSparkDrafter.from_pretrained(ddir, target, torch.float32, DEVICE)


def context_inputs(drafter, tokens=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    aux = torch.randn(tokens, width, generator=gen).to(DEVICE)
    positions = torch.randint(0, 300, (tokens,), generator=gen).to(DEVICE)
    return aux, positions, slot_mapping(tokens, gen, negative=False)


def per_layer_write(drafter, aux, positions, slots, k, v):
    caches = [(k[i], v[i]) for i in range(k.shape[0])]  # a plain list: the per-layer path
    with torch_path():
        drafter.write_context(aux, positions, slots, caches, TorchAttentionBackend())
    return k, v


@torch.no_grad()
def test_drafter_fused_context_write_equals_per_layer_path(tmp_path):
    drafter = drafter_pair(tmp_path)
    aux, positions, slots = context_inputs(drafter)
    shape = (drafter.num_layers, drafter.num_kv_heads, drafter.head_dim)
    k, v = filled_caches(*shape, torch.float32)
    orig_k = k.clone()
    ref_k, ref_v = per_layer_write(drafter, aux, positions, slots, k.clone(), v.clone())
    assert drafter._fused_context is None  # plain lists never take the fused path
    with fused_path():
        drafter.write_context(aux, positions, slots, LayerKVCaches(k, v), None)
    assert drafter._fused_context is not None
    # block 0 is where the torch reference sends padding tokens; the kernel skips them
    torch.testing.assert_close(k[:, 1:], ref_k[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v[:, 1:], ref_v[:, 1:], rtol=1e-5, atol=1e-5)
    assert not torch.equal(k, orig_k)

    # a weight edited in place after the fused write must reach the next one
    with torch.no_grad():
        drafter.layers[1].self_attn.qkv_proj.weight.mul_(-0.5)
        drafter.layers[2].self_attn.k_norm.weight.add_(0.25)
    ref_k, ref_v = per_layer_write(drafter, aux, positions, slots, k.clone(), v.clone())
    with fused_path():
        drafter.write_context(aux, positions, slots, LayerKVCaches(k, v), None)
    torch.testing.assert_close(k[:, 1:], ref_k[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v[:, 1:], ref_v[:, 1:], rtol=1e-5, atol=1e-5)


def test_fused_write_of_a_drafter_built_in_inference_mode(tmp_path):
    """Inference tensors keep no version counter: the stacked copy is keyed on storage."""
    with torch.inference_mode():
        drafter = drafter_pair(tmp_path, num_layers=2)
        aux, positions, slots = context_inputs(drafter, tokens=5)
        k, v = filled_caches(2, drafter.num_kv_heads, drafter.head_dim, torch.float32)
        ref_k, ref_v = per_layer_write(drafter, aux, positions, slots, k.clone(), v.clone())
        with fused_path():
            drafter.write_context(aux, positions, slots, LayerKVCaches(k, v), None)
            drafter.write_context(aux, positions, slots, LayerKVCaches(k, v), None)
    assert drafter._fused_context is not None
    torch.testing.assert_close(k[:, 1:], ref_k[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v[:, 1:], ref_v[:, 1:], rtol=1e-5, atol=1e-5)


def test_training_keeps_the_per_layer_path(tmp_path):
    drafter = drafter_pair(tmp_path, num_layers=2).requires_grad_(True)
    aux, positions, slots = context_inputs(drafter, tokens=4)
    k, v = filled_caches(2, drafter.num_kv_heads, drafter.head_dim, torch.float32)
    with fused_path():  # autograd on: the kernels have no backward
        drafter.write_context(aux, positions, slots, LayerKVCaches(k, v),
                              TorchAttentionBackend())  # fmt: skip
    assert drafter._fused_context is None


def test_new_kv_caches_are_stacked_views(tmp_path):
    drafter = drafter_pair(tmp_path, num_layers=2)
    caches = drafter.new_kv_caches(5, PAGE, DEVICE)
    assert isinstance(caches, LayerKVCaches) and len(caches) == 2
    caches.k[1, 2].fill_(3.0)
    assert caches[1][0][2].eq(3.0).all() and caches[0][0].eq(0).all()
