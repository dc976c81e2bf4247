"""Fused Triton elementwise kernels (dspark.layers.triton_ops) against the torch code they
replace: RMSNorm (+ residual add), per-head q/k RMSNorm + RoPE, RoPE alone, SiLU * up.

On CPU the kernels run through Triton's interpreter at small sizes (TRITON_INTERPRET must be
set before the kernels are imported, hence the setdefault at the top); on CUDA the same cases
run compiled, plus full Qwen3-8B sizes and a CUDA-graph replay. The reference is always the
torch path of the modules (on CUDA with the fused dispatch switched off). fp32 must agree to
rounding noise (the fp32 sum of squares is reduced in another order, and CPU torch uses other
exp/cos/sin implementations than numpy / libdevice); bf16 and fp16 must be bitwise identical
except for rare flips of the last bit (at most 2 + 0.5% of the elements differ, by one
rounding step of the result or of an intermediate).
"""

import contextlib

import pytest
import torch

from tests.kernels import triton_env as env  # first: it sets TRITON_INTERPRET on CPU

DEVICE, cuda_only, ops = env.DEVICE, env.cuda_only, env.ops

import torch.nn.functional as F  # noqa: E402

from dspark.forward_context import ForwardContext, forward_context  # noqa: E402
from dspark.layers.norm import RMSNorm, fused_ops  # noqa: E402
from dspark.layers.rotary import RotaryEmbedding  # noqa: E402
from dspark.models.config import ModelConfig  # noqa: E402
from dspark.models.qwen3 import MLP, Attention  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROPES = {
    "default": {"rope_theta": 1_000_000.0},
    "llama3": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}  # fmt: skip


@contextlib.contextmanager
def torch_path():
    """The modules' torch code, also for CUDA tensors."""
    enabled, ops.ENABLED = ops.ENABLED, False
    try:
        yield
    finally:
        ops.ENABLED = enabled


@contextlib.contextmanager
def fused_path():
    """The modules dispatch to the kernels, on CPU too (through the interpreter)."""
    saved = ops.ON_CPU, ops.ENABLED
    ops.ON_CPU = ops.ENABLED = True
    try:
        yield
    finally:
        ops.ON_CPU, ops.ENABLED = saved


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rand(*shape, dtype=torch.float32, scale=1.0):
    """Random normal values, none of them zero."""
    x = torch.randn(*shape) * scale
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)
    return x.to(dtype=dtype, device=DEVICE)


def check(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.device == ref.device
    if ref.numel() == 0:
        return
    assert torch.isfinite(ref).all()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    eps = torch.finfo(ref.dtype).eps
    differ = (out != ref).sum().item()
    assert differ <= 2 + ref.numel() // 200, f"{differ} of {ref.numel()} elements differ"
    torch.testing.assert_close(out, ref, rtol=eps, atol=eps * ref.abs().max().item())


def norm_module(dim, dtype, eps=1e-6):
    norm = RMSNorm(dim, eps).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(rand(dim, scale=0.3) + 1.0)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 48), (1, 48), (5, 48), (3, 64), (2, 4096), (2, 3, 40)])
@pytest.mark.parametrize("with_residual", [False, True])
@torch.no_grad()
def test_add_rms_norm(dtype, shape, with_residual):
    norm = norm_module(shape[-1], dtype, eps=1e-5)
    x = rand(*shape, dtype=dtype, scale=3.0)
    res = rand(*shape, dtype=dtype) if with_residual else None
    with torch_path():
        ref_y, ref_s = norm.add_forward(x, res)
    y, s = ops.add_rms_norm(x, res, norm.weight, norm.eps)
    check(y, ref_y)
    check(s, ref_s)
    if res is None:
        assert s is x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_rms_norm_strided_heads_and_fp32_weight(dtype):
    # per-head norm of a q view inside a packed qkv row (as the drafter's q_norm sees it)
    qkv = rand(2, 3, 7 * 24, dtype=dtype)
    q = qkv[..., : 4 * 24].view(2, 3, 4, 24)
    norm = norm_module(24, dtype)
    with torch_path():
        check(ops.rms_norm(q, norm.weight, norm.eps), norm(q))
    norm32 = norm_module(24, torch.float32)  # promotes: the output is fp32
    with torch_path():
        check(ops.rms_norm(q, norm32.weight, norm32.eps), norm32(q))


def qkv_views(num_tokens, heads, kv_heads, head_dim, dtype, lead=()):
    """q, k as strided views into a packed [.., (H + 2 Hkv) * D] projection output."""
    width = (heads + 2 * kv_heads) * head_dim
    qkv = rand(*lead, num_tokens, width, dtype=dtype, scale=2.0)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = qkv[..., :q_size].unflatten(-1, (heads, head_dim))
    k = qkv[..., q_size : q_size + kv_size].unflatten(-1, (kv_heads, head_dim))
    return q, k


def positions_for(num_tokens, lead=()):
    pos = torch.tensor([0, 1, 7, 63, 64, 1000, 4095, 65537, 131071, 5][:num_tokens] * 2)
    pos = pos[: num_tokens * (lead[0] if lead else 1)]
    return pos.view(*lead, num_tokens).to(DEVICE)


SHAPES = [  # (T, H, Hkv, D)
    (0, 4, 2, 24), (1, 4, 4, 24), (5, 6, 2, 24), (3, 8, 1, 128), (4, 2, 2, 10), (2, 3, 1, 64),
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qk_norm", [True, False])
@torch.no_grad()
def test_qk_norm_rope(dtype, shape, qk_norm):
    num_tokens, heads, kv_heads, head_dim = shape
    rot = RotaryEmbedding(head_dim, ROPES["default" if heads % 2 else "llama3"]).to(DEVICE)
    q, k = qkv_views(num_tokens, heads, kv_heads, head_dim, dtype)
    pos = positions_for(num_tokens)
    with torch_path():
        if qk_norm:
            q_norm, k_norm = norm_module(head_dim, dtype), norm_module(head_dim, dtype)
            ref_q, ref_k = rot(pos, q_norm(q), k_norm(k))
            out_q, out_k = ops.qk_norm_rope(
                pos, q, k, rot.inv_freq, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps
            )
        else:
            ref_q, ref_k = rot(pos, q, k)
            out_q, out_k = ops.qk_norm_rope(pos, q, k, rot.inv_freq)
        check(out_q, ref_q)
        check(out_k, ref_k)
        out_one, none = ops.qk_norm_rope(pos, k, None, rot.inv_freq)
        assert none is None
        check(out_one, rot.apply_one(pos, k))
        if qk_norm:  # the drafter's context keys: k_norm then RoPE
            out_one = ops.qk_norm_rope(pos, k, None, rot.inv_freq, k_norm.weight, None, k_norm.eps)
            check(out_one[0], rot.apply_one(pos, k_norm(k)))


def tiny_layer_config(dtype, qk_norm: bool) -> ModelConfig:
    """One decoder layer: 4 query heads over 2 KV heads of 24, hidden 48."""
    return ModelConfig(
        architectures=["Qwen3ForCausalLM"], vocab_size=32, hidden_size=48, intermediate_size=40,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        rms_norm_eps=1e-6, rope=ROPES["default"], tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, qk_norm=qk_norm, max_position_embeddings=128,
        dtype=dtype,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_modules_dispatch_to_kernels(dtype):
    """RMSNorm, RotaryEmbedding (incl. the drafter's [R, G, H, D] layout), MLP and Attention
    give the torch path's results when routed through the kernels."""
    cfg = tiny_layer_config(dtype, qk_norm=True)
    attn, mlp = Attention(cfg, 0).to(DEVICE, dtype), MLP(cfg).to(DEVICE, dtype)
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight.copy_(rand(24, scale=0.3, dtype=dtype) + 1)
    rot = RotaryEmbedding(24, cfg.rope).to(DEVICE)
    norm = norm_module(48, dtype)
    x, res = rand(5, 48, dtype=dtype), rand(5, 48, dtype=dtype)
    pos = positions_for(5)
    q4, k4 = qkv_views(3, 4, 2, 24, dtype, lead=(2,))  # drafter: [R, G, H, D], pos [R, G]
    pos4 = positions_for(3, lead=(2,))

    class Capture:  # attention backend stub: records the rotated q/k
        def forward(self, q, k, v, k_cache, v_cache, md, scale):
            self.q, self.k = q, k
            return q

    def run_all():
        cap = Capture()
        with forward_context(ForwardContext(None, cap, [(None, None)])):
            attn_out = attn(pos, x, rot)
        return [
            norm(x), *norm.add_forward(x, res), *norm.add_forward(x, None), mlp(x),
            *rot(pos4, q4, k4), rot.apply_one(pos4, k4),
            *rot.norm_forward(pos4, q4, k4, attn.q_norm, attn.k_norm), attn_out, cap.q, cap.k,
        ]  # fmt: skip

    with torch_path():
        assert fused_ops(x) is None
        refs = run_all()
    with fused_path():
        assert fused_ops(x, norm.weight) is ops
        outs = run_all()
    for out, ref in zip(outs, refs, strict=True):
        check(out, ref)


def test_autograd_keeps_torch_path():
    norm = norm_module(48, torch.float32)
    x = rand(3, 48).requires_grad_()
    with fused_path():
        assert fused_ops(x, norm.weight) is None  # grad needed: the kernels have no backward
        norm(x).sum().backward()
        with torch.no_grad():
            assert fused_ops(x, norm.weight) is ops
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter's numpy exp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 40), (1, 40), (6, 37), (3, 1000), (2, 3, 16)])
@torch.no_grad()
def test_silu_and_mul(dtype, shape):
    gate_up = rand(*shape[:-1], 2 * shape[-1], dtype=dtype, scale=4.0)
    gate_up[..., 0] = -100.0  # exp(-x) overflows to inf: silu = -0
    gate, up = gate_up.split(shape[-1], dim=-1)
    check(ops.silu_and_mul(gate_up), F.silu(gate) * up)


# ---------------------------------------------------------------- CUDA: full size, graphs


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 256, 3000])
@torch.no_grad()
def test_qwen3_8b_sizes(dtype, num_tokens):
    d, heads, kv_heads, head_dim, inter = 4096, 32, 8, 128, 12288
    norm, q_norm, k_norm = norm_module(d, dtype), norm_module(128, dtype), norm_module(128, dtype)
    rot = RotaryEmbedding(head_dim, ROPES["default"]).to(DEVICE)
    x, res = rand(num_tokens, d, dtype=dtype), rand(num_tokens, d, dtype=dtype)
    q, k = qkv_views(num_tokens, heads, kv_heads, head_dim, dtype)
    pos = torch.randint(0, 40000, (num_tokens,), device=DEVICE)
    gate_up = rand(num_tokens, 2 * inter, dtype=dtype, scale=3.0)
    with torch_path():
        refs = [*norm.add_forward(x, res), *rot(pos, q_norm(q), k_norm(k))]
        refs.append(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
    outs = [*ops.add_rms_norm(x, res, norm.weight, norm.eps)]
    outs += ops.qk_norm_rope(pos, q, k, rot.inv_freq, q_norm.weight, k_norm.weight, 1e-6, 1e-6)
    outs.append(ops.silu_and_mul(gate_up))
    for out, ref in zip(outs, refs, strict=True):
        check(out, ref)


@cuda_only
@torch.no_grad()
def test_cuda_graph_replay():
    dtype, num_tokens = torch.bfloat16, 8
    norm, q_norm, k_norm = norm_module(256, dtype), norm_module(64, dtype), norm_module(64, dtype)
    rot = RotaryEmbedding(64, ROPES["default"]).to(DEVICE)
    x, res = rand(num_tokens, 256, dtype=dtype), rand(num_tokens, 256, dtype=dtype)
    q, k = qkv_views(num_tokens, 4, 2, 64, dtype)
    pos = torch.arange(num_tokens, device=DEVICE)
    gate_up = rand(num_tokens, 2 * 96, dtype=dtype)

    def step():
        y, s = norm.add_forward(x, res)
        return [y, s, *rot.norm_forward(pos, q, k, q_norm, k_norm), ops.silu_and_mul(gate_up)]

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in (x, res, q, k, gate_up):  # new inputs in the same buffers, then replay
        t.copy_(rand(*t.shape, dtype=dtype))
    pos.copy_(torch.randint(0, 9000, (num_tokens,), device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    with torch_path():
        refs = step()
    for out, ref in zip(outs, refs, strict=True):
        check(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4, 4, 24), (5, 6, 2, 24), (3, 8, 1, 128), (4, 2, 2, 10)])
@pytest.mark.parametrize("qk_norm", [True, False])
@torch.no_grad()
def test_qk_norm_rope_to_cache_equals_rope_then_write(dtype, shape, qk_norm):
    """Keys and values stored by the rotary kernel itself: the same q as `qk_norm_rope`, the
    cache as `qk_norm_rope` + `write_kv` leave it (bitwise: the same arithmetic), padding
    tokens (sentinel or negative slot) and every other slot untouched."""
    from dspark.attention.base import SENTINEL_SLOT
    from dspark.attention.triton.kv_write import write_kv

    num_tokens, heads, kv_heads, head_dim = shape
    rot = RotaryEmbedding(head_dim, ROPES["default"]).to(DEVICE)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = rand(num_tokens, width, dtype=dtype, scale=2.0)
    q = qkv[:, : heads * head_dim].unflatten(-1, (heads, head_dim))
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].unflatten(-1, (kv_heads, head_dim))
    v = qkv[:, (heads + kv_heads) * head_dim :].unflatten(-1, (kv_heads, head_dim))
    pos = positions_for(num_tokens)
    slots = (torch.randperm(40)[:num_tokens] + 8).to(DEVICE)
    if num_tokens >= 3:
        slots[1], slots[2] = SENTINEL_SLOT, -1
    k_cache, v_cache = (rand(12, 4, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    ref_k, ref_v, orig_k = k_cache.clone(), v_cache.clone(), k_cache.clone()
    norms = ()
    if qk_norm:
        q_norm, k_norm = norm_module(head_dim, dtype), norm_module(head_dim, dtype)
        norms = (q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps)
    ref_q, rot_k = ops.qk_norm_rope(pos, q, k, rot.inv_freq, *norms)
    keep = slots >= 0  # write_kv skips the sentinel's block through the kernel: mirror it
    write_kv(rot_k[keep], v[keep], ref_k, ref_v, slots[keep])
    out_q = ops.qk_norm_rope_to_cache(pos, q, k, v, rot.inv_freq, slots, k_cache, v_cache,
                                      *norms)  # fmt: skip
    assert torch.equal(out_q, ref_q)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert not torch.equal(k_cache, orig_k)  # (the comparison is not of two untouched caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
@torch.no_grad()
def test_attention_layer_stores_kv_from_the_rotary_kernel(dtype, qk_norm, monkeypatch):
    """Qwen3 / Llama attention through a backend that attends over already-written K/V: the
    rotary kernel stores keys and values, the backend only attends; output and cache equal
    the torch path's (which rotates, then has the backend write and attend)."""
    from dspark.attention.torch_ref import TorchAttentionBackend
    from tests.kernels.test_triton_attention import make_step

    cfg = tiny_layer_config(dtype, qk_norm)
    attn = Attention(cfg, 0).to(DEVICE, dtype)
    if qk_norm:
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(rand(24, scale=0.3, dtype=dtype) + 1)
    rot = RotaryEmbedding(24, cfg.rope).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    md, *_, k_cache, v_cache = make_step(gen, [1, 3, 1], [5, 2, 9], 4, 4, 2, 24, dtype,
                                         num_pad=1)  # fmt: skip
    x = rand(md.slot_mapping.numel(), 48, dtype=dtype)

    def run(caches):
        with forward_context(ForwardContext(md, TorchAttentionBackend(), [caches])):
            return attn(md.positions, x, rot)

    ref_caches = (k_cache.clone(), v_cache.clone())
    with torch_path():
        ref = run(ref_caches)
    calls, kernel = [], ops.qk_norm_rope_to_cache
    monkeypatch.setattr(ops, "qk_norm_rope_to_cache", lambda *a: calls.append(1) or kernel(*a))
    with fused_path():
        out = run((k_cache, v_cache))
    assert calls == [1]  # (the fused path ran)
    slot = torch.arange(k_cache.shape[0] * 4, device=DEVICE)
    real = torch.isin(slot, md.slot_mapping)
    real[:4] = False  # block 0: where the torch path writes padding tokens; never read
    for got, want in zip((k_cache, v_cache), ref_caches, strict=True):
        got, want = got.view(-1, 2, 24), want.view(-1, 2, 24)
        check(got[real], want[real])
        assert torch.equal(got[4:][~real[4:]], want[4:][~real[4:]])  # nothing else written
    n = int(md.query_start_loc[-1])
    check(out[:n], ref[:n])
