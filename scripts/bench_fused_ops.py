"""Torch path vs fused Triton kernels for the elementwise work of a Qwen3-8B decoder layer (CUDA).

Per layer: input RMSNorm with the residual add, q/k per-head RMSNorm + RoPE, post-attention
RMSNorm with the residual add, SiLU(gate) * up. Each op (and the whole set) is captured in a
CUDA graph of `LAYERS` repetitions (one decode step's worth), timed with
`triton.testing.do_bench` (median) and reported per layer; plus the CUDA kernels one layer
launches (torch profiler) and the share of output elements that are bitwise identical between
the two paths. Then the once-per-step work that fused kernels replaced (the drafter's context
write, the lagged policy's allocation, a sampled draft slot, sampled verification), before and
after.

    python scripts/bench_fused_ops.py [--tokens 1 256] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout
from dspark.layers import triton_ops  # noqa: E402
from dspark.layers.norm import RMSNorm  # noqa: E402
from dspark.layers.rotary import RotaryEmbedding  # noqa: E402
from dspark.models.config import ModelConfig  # noqa: E402
from dspark.models.qwen3 import MLP  # noqa: E402

LAYERS = 36
DEV = "cuda"  # (build_step_ops: a CPU smoke test sets "cpu" with the interpreter)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS = 4096, 32, 8, 128, 12288, 1e-6


class _Act(torch.nn.Module):
    """MLP's activation alone (gate_up_proj skipped): the body of qwen3.MLP.forward."""

    def __init__(self, dtype):
        super().__init__()
        cfg = ModelConfig(
            architectures=["Qwen3ForCausalLM"], vocab_size=8, hidden_size=8,
            intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, head_dim=8, rms_norm_eps=EPS, rope={}, qk_norm=True,
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
            max_position_embeddings=8, dtype=dtype,
        )  # fmt: skip
        self.mlp = MLP(cfg)
        self.mlp.gate_up_proj = torch.nn.Identity()  # input is already gate_up
        self.mlp.down_proj = torch.nn.Identity()

    def forward(self, gate_up):
        return self.mlp(gate_up)


def build(num_tokens: int, dtype: torch.dtype):
    torch.manual_seed(0)
    dev = "cuda"

    def norm(dim):
        n = RMSNorm(dim, EPS).to(dev)
        with torch.no_grad():
            n.weight.normal_(1.0, 0.2)
        return n.to(dtype)

    in_norm, post_norm, q_norm, k_norm = norm(HIDDEN), norm(HIDDEN), norm(HEAD_DIM), norm(HEAD_DIM)
    rot = RotaryEmbedding(HEAD_DIM, {"rope_theta": 1_000_000.0}).to(dev)
    act = _Act(dtype).to(dev)
    x = torch.randn(num_tokens, HIDDEN, device=dev, dtype=dtype)
    res = torch.randn(num_tokens, HIDDEN, device=dev, dtype=dtype)
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=dtype)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    q = qkv[:, :q_size].view(-1, HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(-1, KV_HEADS, HEAD_DIM)
    pos = torch.randint(0, 32768, (num_tokens,), device=dev)
    gate_up = torch.randn(num_tokens, 2 * INTER, device=dev, dtype=dtype)
    ops = {
        "add+rmsnorm (x2/layer)": lambda: in_norm.add_forward(x, res),
        "q/k norm + rope": lambda: rot.norm_forward(pos, q, k, q_norm, k_norm),
        "silu * up": lambda: act(gate_up),
    }
    ops["layer total"] = lambda: (
        in_norm.add_forward(x, res), rot.norm_forward(pos, q, k, q_norm, k_norm),
        post_norm.add_forward(x, res), act(gate_up),
    )  # fmt: skip
    return ops


def build_step_ops(num_tokens: int, dtype: torch.dtype) -> dict:
    """Work that fused kernels replaced, as (before, after) pairs over `num_tokens` tokens: a
    target layer's rotary kernel and KV write (after: the kernel stores K/V itself); the
    DSpark drafter's context write for the 8B shape's drafter (5 layers; before: per layer a
    GEMM, k_norm, RoPE and KV write, after: drafter_context.py); the lagged policy's
    allocation over `num_tokens` requests x 7 drafts (before: the torch sort, after: one
    launch); sampled verification of `num_tokens` requests x 7 drafts (before: full-vocabulary
    probabilities of every row, after: softmax_sample_triton)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_shape_dirs import QWEN3_8B, drafter_config

    from dspark.attention.triton.kv_write import write_kv
    from dspark.models.drafter_context import FusedContext, LayerKVCaches
    from dspark.models.dspark_drafter import DrafterConfig, DrafterLayer
    from dspark.spec.allocation import allocate_top_b

    torch.manual_seed(0)
    cfg = DrafterConfig.from_dict(dict(drafter_config(QWEN3_8B), dtype=str(dtype)[6:]))
    torch.set_default_dtype(dtype)
    try:
        layers = [DrafterLayer(cfg).to(DEV) for _ in range(cfg.num_hidden_layers)]
    finally:
        torch.set_default_dtype(torch.float32)
    rot = RotaryEmbedding(HEAD_DIM, {"rope_theta": 1_000_000.0}).to(DEV)
    blocks = num_tokens // 16 + 2
    shape = (len(layers), blocks, 16, KV_HEADS, HEAD_DIM)
    caches = LayerKVCaches(torch.zeros(shape, device=DEV, dtype=dtype),
                           torch.zeros(shape, device=DEV, dtype=dtype))  # fmt: skip
    h = torch.randn(num_tokens, HIDDEN, device=DEV, dtype=dtype)
    pos = torch.randint(0, 32768, (num_tokens,), device=DEV)
    slots = torch.arange(num_tokens, device=DEV) + 16
    fused = FusedContext(layers)

    def per_layer():
        for layer, (kc, vc) in zip(layers, caches, strict=True):
            write_kv(*layer.self_attn.context_kv(h, pos, rot), kc, vc, slots)

    conf = torch.rand(num_tokens, 7, device=DEV)
    caps = torch.full((num_tokens,), 7, device=DEV)
    budget = torch.tensor(num_tokens * 3, device=DEV)

    def fused_or_not(fn, triton_on: bool):  # fn with the fused kernels on or off
        def run():
            triton_ops.ENABLED = triton_on
            try:
                return fn()
            finally:
                triton_ops.ENABLED = True
        return run

    def allocation(triton_on: bool):
        return fused_or_not(lambda: allocate_top_b(conf, caps, budget), triton_on)

    # a target layer's q/k norm + RoPE, then its KV write; after: stored by the rotary kernel
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEV, dtype=dtype)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (t.view(num_tokens, -1, HEAD_DIM) for t in (q, k, v))
    attn = layers[0].self_attn
    norms = (attn.q_norm, attn.k_norm)

    def rope_then_write():
        write_kv(*rot.norm_forward(pos, q, k, *norms)[1:], v, caches[0][0], caches[0][1], slots)

    # sampled verification (standard method, T = 1) of num_tokens requests x 7 drafts over
    # the 8B vocabulary; before: processed_probs over every row, after: one pass per row
    from dspark.spec.verify import VerifyInputs, verify

    vocab, kk = QWEN3_8B["vocab_size"], 7
    cu = torch.arange(num_tokens + 1, device=DEV) * (kk + 1)
    vin = VerifyInputs(
        target_logits=torch.randn(num_tokens * (kk + 1), vocab, device=DEV, dtype=dtype) * 3,
        cu_num_logits=cu, draft_token_ids=torch.randint(0, vocab, (num_tokens, kk), device=DEV),
        draft_probs=torch.softmax(torch.randn(num_tokens, kk, vocab, device=DEV), -1),
        temperature=torch.ones(num_tokens, device=DEV), top_k=None, top_p=None, min_p=None,
        seeds=torch.arange(num_tokens, device=DEV), anchor_positions=cu[:-1] + 100,
        rounds=torch.zeros(num_tokens, dtype=torch.int64, device=DEV),
    )  # fmt: skip

    def sampled_verify(triton_on: bool):
        return fused_or_not(lambda: verify(vin), triton_on)

    # one probabilistic draft slot (T = 1) over the 8B vocabulary: the drafter's torch path
    # (upcast, bias, softmax, inverse CDF, copy into the [R, K, V] buffer) against one kernel
    from dspark.sampling import rng as rng_mod
    from dspark.sampling.processors import GREEDY_EPS, processed_probs, sample_from_probs
    from dspark.sampling.softmax_sample_triton import sample_softmax

    slot_base = torch.randn(num_tokens, kk, vocab, device=DEV, dtype=dtype)[:, 3] * 3
    slot_bias = torch.randn(num_tokens, vocab, device=DEV)
    slot_probs = torch.empty(num_tokens, kk, vocab, device=DEV)
    slot_tok = torch.empty(num_tokens, kk, dtype=torch.int64, device=DEV)
    ones = torch.ones(num_tokens, device=DEV)

    def draft_slot_torch():
        p = processed_probs(slot_base.float() + slot_bias.float(), ones)
        u = rng_mod.uniform(vin.seeds, vin.anchor_positions, vin.rounds, rng_mod.DRAFT)
        slot_tok[:, 3] = sample_from_probs(p, u)
        slot_probs[:, 3] = p
        return slot_tok[:, 3], slot_probs[:, 3]

    def draft_slot_fused():
        u = rng_mod.uniform(vin.seeds, vin.anchor_positions, vin.rounds, rng_mod.DRAFT)
        sample_softmax(slot_base, slot_bias, ones, u, GREEDY_EPS, slot_tok[:, 3],
                       slot_probs[:, 3])  # fmt: skip
        return slot_tok[:, 3], slot_probs[:, 3]

    return {
        f"sampled draft slot ({num_tokens})": (draft_slot_torch, draft_slot_fused),
        f"sampled verify ({num_tokens} x 7)": (sampled_verify(False), sampled_verify(True)),
        "rope + KV write (layer)": (rope_then_write, lambda: rot.forward_to_cache(
            pos, q, k, v, slots, caches[0][0], caches[0][1], *norms)),
        "drafter context write": (per_layer, lambda: fused.write(h, pos, slots, caches,
                                                                 rot.inv_freq.float())),
        f"allocation ({num_tokens} x 7)": (allocation(False), allocation(True)),
    }  # fmt: skip


def graph_us(fn, reps: int) -> float:
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    ms = do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return 1e3 * ms / reps


def kernels_launched(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in flat(o)]


def identical(a, b) -> float:
    same = sum((x == y).sum().item() for x, y in zip(flat(a), flat(b), strict=True))
    return same / sum(x.numel() for x in flat(a))


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  Qwen3-8B layer "
          f"(d={HIDDEN}, heads {HEADS}/{KV_HEADS}x{HEAD_DIM}, I={INTER}); us per layer, "
          f"graphs of {LAYERS} repetitions")  # fmt: skip
    head = f"{'T':>5} {'op':<24} {'torch us':>9} {'fused us':>9} {'speedup':>8} "
    print(head + f"{'kernels':>9} {'identical':>10}")
    for num_tokens in args.tokens:
        for name, fn in build(num_tokens, dtype).items():
            triton_ops.ENABLED = False
            t_torch, k_torch, ref = graph_us(fn, LAYERS), kernels_launched(fn), fn()
            triton_ops.ENABLED = True
            t_fused, k_fused, out = graph_us(fn, LAYERS), kernels_launched(fn), fn()
            print(f"{num_tokens:>5} {name:<24} {t_torch:>9.2f} {t_fused:>9.2f} "
                  f"{t_torch / t_fused:>7.1f}x {k_torch:>4}->{k_fused:<4} "
                  f"{100 * identical(out, ref):>9.4f}%")  # fmt: skip
        print(f"{'':>5} per step ({LAYERS} layers): {t_torch * LAYERS / 1e3:.3f} ms -> "
              f"{t_fused * LAYERS / 1e3:.3f} ms")  # fmt: skip
    print("once per step (us per call; 'before' is the path each replaced):")
    for num_tokens in args.tokens:
        for name, (before, after) in build_step_ops(num_tokens, dtype).items():
            t0, k0 = graph_us(before, 8), kernels_launched(before)
            t1, k1 = graph_us(after, 8), kernels_launched(after)
            print(f"{num_tokens:>5} {name:<24} {t0:>9.2f} {t1:>9.2f} {t0 / t1:>7.1f}x "
                  f"{k0:>4}->{k1:<4}")  # fmt: skip


if __name__ == "__main__":
    main()
