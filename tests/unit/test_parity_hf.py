"""Greedy outputs equal Hugging Face transformers token for token (fp32, CPU)."""

import pytest
import torch
import transformers

from dspark import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 57)), [3], list(range(100, 113)), [7, 7, 7, 7]]
MAX_NEW = 20


def hf_greedy(path, prompts, max_new=MAX_NEW):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # ignore EOS like our ignore_eos=True (min_new_tokens would instead mask EOS's logit)
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), do_sample=False, max_new_tokens=max_new, pad_token_id=0,
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
        )  # fmt: skip
        outs.append(ids[0, len(p) :].tolist())
    return outs


def ours(path, prompts, **kwargs):
    llm = LLM(path, device="cpu", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "shape",
    ["qwen3_gqa2", "qwen3_mha_oddhead", "qwen3_gqa4_tied", "llama3_rope_gqa2", "llama_tied_mqa"],
)
def test_greedy_matches_hf_batched_and_chunked(ckpt_dir, shape):
    path = ckpt_dir(shape)
    ref = hf_greedy(path, PROMPTS)
    # whole batch at once, large token budget
    _, got = ours(path, PROMPTS, max_num_batched_tokens=512)
    assert got == ref
    # chunked prefill forced: 7-token budget, odd block size
    _, got = ours(path, PROMPTS, max_num_batched_tokens=7, block_size=4)
    assert got == ref


def test_sharded_checkpoint_and_prefix_cache_hits(ckpt_dir):
    path = ckpt_dir("qwen3_gqa2", max_shard_size="40KB")
    shared = list(range(30, 62))  # 32 shared tokens = 8 full blocks of 4
    prompts = [shared + [1, 2], shared + [9], shared + [4, 4, 4]]
    ref = hf_greedy(path, prompts)
    llm = LLM(path, device="cpu", block_size=4, max_num_batched_tokens=64, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = []
    for p in prompts:  # one after another, so later prompts hit the cached prefix
        out = llm.generate([{"prompt_token_ids": p}], params)[0]
        got.append(out.outputs[0].token_ids)
        last_cached = out.metrics.num_cached_tokens
    assert got == ref
    assert last_cached == 32
    assert llm.engine.block_manager.num_prefix_hits >= 64


def test_preemption_by_recompute_keeps_outputs(ckpt_dir):
    path = ckpt_dir("llama3_rope_gqa2")
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    ref = hf_greedy(path, prompts)
    # 24 blocks of 4 slots = 92 usable slots for 6 requests of 50 tokens: must preempt
    llm, got = ours(path, prompts, block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    assert got == ref
    assert llm.engine.stats["preemptions"] > 0
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == 23


@pytest.mark.parametrize("shape", ["qwen3_gqa2", "llama3_rope_gqa2"])
def test_aux_hidden_states_are_the_hf_layers_outputs(ckpt_dir, shape):
    """What the drafter's context is built from: each requested decoder layer's output (its
    hidden + residual, as an HF layer returns it), the last layer's included, taken from the
    residual add that follows each layer."""
    path = ckpt_dir(shape)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n_layers = hf.config.num_hidden_layers
    ids = list(range(20, 57))
    outputs = {}
    hooks = [hf.model.layers[i].register_forward_hook(
        lambda _m, _a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in range(n_layers)]  # fmt: skip
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    llm = LLM(path, device="cpu", max_num_batched_tokens=512)
    runner, seen = llm.engine.runner, []
    wanted = (n_layers - 1, 0, 1) if n_layers > 2 else (n_layers - 1, 0)
    runner.aux_layer_ids = wanted
    forward = runner.eager_forward

    def capturing(input_ids, md):
        hidden, aux = forward(input_ids, md)
        seen.append(aux)
        return hidden, aux

    runner.eager_forward = capturing
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1))
    aux = seen[0]  # the prefill step: the prompt's tokens in order
    d = hf.config.hidden_size
    assert aux.shape == (len(ids), len(wanted) * d)
    for j, layer in enumerate(wanted):
        torch.testing.assert_close(aux[:, j * d : (j + 1) * d], outputs[layer][0],
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
