"""The fused greedy-draft argmax (dspark.layers.argmax_triton) against torch's
(base.float() + bias.float()).max(-1), and the drafter's greedy proposals with and without it.

On CPU the kernels run through Triton's interpreter at small vocabularies with small column
blocks (many chunks per row, so the cross-chunk combine is exercised); on CUDA also at a
Qwen3 vocabulary and inside a CUDA graph. Indices must be identical: the sum is the same fp32
add of the same two upcast values, and ties go to the first index in both.
"""

import pytest
import torch

from tests.kernels import triton_env as env  # first: it sets TRITON_INTERPRET on CPU

DEVICE, HAS_CUDA, INTERPRET, cuda_only, ops = (env.DEVICE, env.HAS_CUDA, env.INTERPRET,
                                               env.cuda_only, env.ops)  # fmt: skip

from dspark.layers.argmax_triton import biased_argmax  # noqa: E402

BLOCK = 64 if INTERPRET else 2048


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum per row (torch's max does not promise which tie it takes)."""
    cols = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(x == x.max(-1, keepdim=True).values, cols, x.shape[-1]).min(-1).values


def reference(base, bias):
    x = base.float() if bias is None else base.float() + bias.float()
    return first_argmax(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 1000), (5, 999), (3, 64), (2, 37)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_torch(dtype, rows, vocab, with_bias):
    g = torch.Generator().manual_seed(rows * vocab)
    base = (torch.randn(rows, 3, vocab, generator=g) * 4).to(dtype).to(DEVICE)
    bias = (torch.randn(rows, vocab, generator=g) * 4).to(dtype).to(DEVICE) if with_bias else None
    out = torch.full((rows, 3), -1, dtype=torch.int64, device=DEVICE)
    biased_argmax(base[:, 1], bias, out[:, 2], block=BLOCK)  # a slot's slice, a column out
    assert torch.equal(out[:, 2], reference(base[:, 1], bias))
    assert (out[:, :2] == -1).all()  # nothing else written


def test_ties_take_the_first_index_across_chunks():
    vocab, rows = 1000, 4
    base = torch.randn(rows, vocab).to(torch.bfloat16)
    bias = torch.randn(rows, vocab).to(torch.bfloat16)
    top = float((base.float() + bias.float()).max()) + 8.0
    # the same maximum at two columns in different chunks (and once twice in one block)
    for r, cols in enumerate([(5, 900), (130, 131), (999, 64), (0, 999)]):
        for c in cols:
            base[r, c], bias[r, c] = top, 0.0
    out_dev = torch.empty(rows, dtype=torch.int64, device=DEVICE)
    biased_argmax(base.to(DEVICE), bias.to(DEVICE), out_dev, block=BLOCK)
    assert out_dev.cpu().tolist() == [5, 130, 64, 0]


def test_no_rows():
    out = torch.empty(0, dtype=torch.int64, device=DEVICE)
    biased_argmax(torch.empty(0, 50, device=DEVICE), None, out)


@cuda_only
@torch.no_grad()
def test_qwen3_vocabulary_in_a_cuda_graph():
    rows, vocab = 128, 151936
    base = (torch.randn(rows, 7, vocab, device="cuda") * 3).to(torch.bfloat16)
    bias = (torch.randn(rows, vocab, device="cuda") * 3).to(torch.bfloat16)
    out = torch.empty(rows, 7, dtype=torch.int64, device="cuda")
    biased_argmax(base[:, 6], bias, out[:, 6])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        biased_argmax(base[:, 6], bias, out[:, 6])
    base.copy_((torch.randn(rows, 7, vocab, device="cuda") * 3).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out[:, 6], reference(base[:, 6], bias))


# (gated / rnn heads differ from vanilla only in the torch code computing the bias)
@pytest.mark.parametrize("head", ["vanilla", "dflash"])
@torch.no_grad()
def test_drafter_greedy_proposals_are_the_same_through_the_kernel(tmp_path, head, monkeypatch):
    from dspark.models.dspark_drafter import DSparkDrafter
    from dspark.testing.checkpoints import TinyShape, make_tiny_target
    from dspark.testing.drafters import make_tiny_drafter
    from tests.unit.test_drafter import Batch, load_target

    target_dir = make_tiny_target(str(tmp_path / "t"), TinyShape(num_hidden_layers=2), seed=1)
    target = load_target(target_dir)
    ddir = make_tiny_drafter(str(tmp_path / "d"), target_dir, num_layers=1, seed=3,
                             markov_rank=0 if head == "dflash" else 8,
                             markov_head_type="vanilla" if head == "dflash" else head,
                             confidence_head_with_markov=head != "dflash")
    drafter = DSparkDrafter.from_pretrained(ddir, target, torch.float32, "cpu")
    batch = Batch(drafter, ctx_lens=[9, 5, 12], anchor_pos=[9, 3, 12], seed=2)
    args = (6, torch.zeros(3), torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.long),
            "greedy", False)
    ref = batch.propose(*args)
    calls = []
    import dspark.layers.argmax_triton as kernel

    real = kernel.biased_argmax
    monkeypatch.setattr(kernel, "biased_argmax", lambda *a, **k: calls.append(1) or real(*a))
    monkeypatch.setattr(ops, "ON_CPU", True)
    if HAS_CUDA:  # the drafter is on CPU here: only the interpreter can run the kernel
        pytest.skip("CPU drafter; the CUDA path is covered by the e2e identity tests")
    fused = batch.propose(*args)
    assert len(calls) == 6  # one fused pass per slot
    assert torch.equal(fused.token_ids, ref.token_ids)
    # (ON_CPU also sends the backbone's norms / RoPE / SiLU through their kernels: ulp-level)
    if ref.conf_logits is not None:
        torch.testing.assert_close(fused.conf_logits, ref.conf_logits, rtol=1e-5, atol=1e-6)


@cuda_only
def test_an_engine_drafts_the_same_with_torchs_argmax(tmp_path, monkeypatch):
    """On CUDA the drafter's greedy slots go through the kernel (inside the whole-step graphs).
    With it replaced by torch's first-index argmax, an engine drafts the same tokens: the same
    output (lossless either way) and the same drafts accepted at every position."""
    import dspark.layers.argmax_triton as kernel
    from dspark import LLM, SamplingParams
    from dspark.testing.checkpoints import TinyShape, make_tiny_target
    from dspark.testing.drafters import make_tiny_drafter

    target = make_tiny_target(str(tmp_path / "t"), TinyShape(num_hidden_layers=2), seed=1)
    drafter = make_tiny_drafter(str(tmp_path / "d"), target, seed=3)
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run():
        llm = LLM(target, device="cuda", num_kv_blocks=1024, max_num_seqs=8,
                  speculative_config={"model": drafter, "num_speculative_tokens": 4})
        outs = llm.generate(prompts, params)
        st = llm.engine.spec_stats
        got = ([o.outputs[0].token_ids for o in outs], st.num_drafted_tokens,
               st.num_accepted_tokens, list(st.accepted_per_pos))  # fmt: skip
        llm.shutdown()
        return got

    calls, real = [], kernel.biased_argmax
    monkeypatch.setattr(kernel, "biased_argmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = run()
    assert calls  # the drafter took the kernel

    def torch_argmax(base, bias, out, block=None):
        out.copy_(reference(base, bias))

    monkeypatch.setattr(kernel, "biased_argmax", torch_argmax)
    assert run() == fused
