"""How many KV-cache blocks a model runner allocates, and what the drafter's share of them
costs.

A block holds `block_size` tokens of every target layer's keys and values and, with
speculation, of every drafter layer's too: the drafter attends over its own K/V of the context
(written every step, plain ones included), so the same memory holds fewer blocks. On the GPU
the blocks fill what `gpu_memory_utilization` leaves after the weights, the step's
activations and the prefill graphs' memory pools; on the CPU, `cpu_kv_cache_gb`.
"""

from __future__ import annotations

import torch


def bytes_per_block(runner) -> int:
    """One block's bytes on this rank: the target's K/V of every layer, plus the drafter's."""
    c = runner.model_cfg
    elem = torch.empty((), dtype=runner.dtype).element_size()
    num_kv_heads = c.num_key_value_heads // runner.tp.size  # this rank's
    per = 2 * c.num_hidden_layers * runner.block_size * num_kv_heads * c.head_dim * elem
    if runner.spec is not None:
        per += runner.spec.drafter.kv_cache_bytes_per_block(runner.block_size)
    return per


def num_kv_blocks(runner) -> int:
    """The cache size: `num_kv_blocks` when configured, else what memory holds (the least over
    tensor-parallel ranks)."""
    config = runner.config
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_block(runner)
    if runner.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(runner.device)
        c = runner.model_cfg
        tokens = config.max_num_batched_tokens
        act = tokens * (8 * c.hidden_size + 4 * c.intermediate_size) * 4
        act += min(tokens, config.max_num_seqs * 8) * c.vocab_size * 4 * 4
        pools = runner._graphs_of_prefill_chunks()  # their memory pools stay allocated
        if pools:
            from dspark.engine.cuda_graph import PREFILL_GRAPH_MAX_TOKENS

            act += pools * min(tokens, PREFILL_GRAPH_MAX_TOKENS) * (
                4 * c.hidden_size + 2 * c.intermediate_size) * 2  # fmt: skip
        budget = free - (1 - config.gpu_memory_utilization) * total - act
    else:
        budget = config.cpu_kv_cache_gb * (1 << 30)
    num = int(budget // per_block)
    if runner.world is not None:  # every rank's cache holds the same blocks
        num = runner.world.min_over_ranks(num)
    if num < 2:
        raise RuntimeError("not enough memory for the KV cache; lower max_num_batched_tokens")
    return num


def drafter_share(runner) -> str:
    """For the start-up log: the share of each block the drafter's context K/V takes and, where
    the cache was sized from memory, the blocks the same memory would hold without it (empty
    without a drafter). A batch that fits without speculation may not fit with it: H100, 8B
    shape, 5 drafter layers beside 36, 12.2% of each block, 10,894 blocks against no-spec's
    12,407, and at c = 256 with 768-token sequences the speculative engine preempted where
    no-spec did not (forty-second session)."""
    if runner.spec is None:
        return ""
    share = runner.spec.drafter.kv_cache_bytes_per_block(runner.block_size)
    share /= bytes_per_block(runner)
    line = f"; the drafter's context K/V takes {share:.1%} of each block"
    if runner.config.num_kv_blocks is None:
        line += f", {int(runner.num_blocks / (1.0 - share))} blocks without it"
    return line
