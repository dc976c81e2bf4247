"""The drafter's context projection (fc: m target layer outputs [T, m*d] -> [T, d]) on CUDA: one
GEMM against the same product split over the m layer slices (a batched GEMM of m partials,
summed in fp32), at the token counts a step writes (decode rows alone, rows beside a prompt
chunk, a full prefill budget). Its K = m*d is long beside N = d, so at a few hundred tokens
one GEMM has few output tiles for the SMs; the split gives m times as many. (H200, thirtieth
session: the one GEMM ran within 1.09-1.36x its floor from 64 to 8,192 tokens, and the split
was slower at every size, so the engine keeps the one GEMM.)

Each variant is captured in a CUDA graph and timed with `triton.testing.do_bench` (median);
TFLOP/s and the gap to the better of the bf16 matmul and weight-read floors (this machine's
own rates) are printed, and the split's largest difference from the one GEMM, relative to the
output's scale.

    python scripts/bench_context_fc.py [--tokens 64 256 768 2048 8192] [--layers 5]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench


def graph_us(fn) -> float:
    """Median µs of `fn` replayed from a CUDA graph (launch overhead excluded)."""
    fn()  # (warm-up: cuBLAS picks its kernel outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=200) * 1e3


def split_fc(x: torch.Tensor, w_split: torch.Tensor) -> torch.Tensor:
    """x [T, m*d] @ W^T as m partial products (a batched GEMM) summed in fp32; w_split is W
    [d, m*d] laid out as [m, d_in, d_out]."""
    m, d_in, _ = w_split.shape
    parts = torch.bmm(x.view(-1, m, d_in).transpose(0, 1), w_split)  # [m, T, d]
    return parts.sum(0, dtype=torch.float32).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 768, 2048, 8192])
    ap.add_argument("--layers", type=int, default=5, help="target layers the drafter reads (m)")
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()
    d, m = args.hidden, args.layers
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(d, m * d, device=dev, dtype=dt, generator=gen) * (m * d) ** -0.5
    w_split = w.view(d, m, d).permute(1, 2, 0).contiguous()  # [m, d_in, d_out]
    w_t = w.t().contiguous()  # [m*d, d]: the same GEMM with the weight stored transposed
    a = torch.randn(8192, 8192, device=dev, dtype=dt)
    flops = do_bench(lambda: a @ a, warmup=10, rep=100) * 1e-3
    tflops = 2 * 8192**3 / flops / 1e12
    buf = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_s = do_bench(lambda: buf[: 1 << 29].copy_(buf[1 << 29 :]), warmup=5, rep=50) * 1e-3
    bw = 2 * (1 << 29) / copy_s / 1e12  # TB/s (read + write)
    print(f"bf16 matmul {tflops:.0f} TFLOP/s, copy {bw:.2f} TB/s; fc {m}x{d} -> {d}")
    for t in args.tokens:
        x = torch.randn(t, m * d, device=dev, dtype=dt, generator=gen)
        one = graph_us(lambda x=x: torch.nn.functional.linear(x, w))
        split = graph_us(lambda x=x: split_fc(x, w_split))
        nn = graph_us(lambda x=x: x @ w_t)
        ref = torch.nn.functional.linear(x, w).float()
        err = ((split_fc(x, w_split).float() - ref).abs().max() / ref.abs().max()).item()
        flop = 2 * t * m * d * d
        floor = max(flop / (tflops * 1e12), (w.numel() * 2 + x.numel() * 2) / (bw * 1e12)) * 1e6
        print(f"T={t:5d}  one GEMM {one:8.1f} us ({flop / one / 1e6:5.0f} TFLOP/s, "
              f"{one / floor:4.2f}x floor)  split over {m} {split:8.1f} us "
              f"({split / floor:4.2f}x)  W^T stored {nn:8.1f} us  floor {floor:7.1f} us  "
              f"max diff {err:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
