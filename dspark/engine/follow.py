"""Speculative steps scheduled while the previous one is still on the device ("following").

A speculative step's outcome (how many tokens each row emits) is known only once it has run,
so until the fifty-fourth session the engine waited for every step that verifies or drafts
before scheduling the next: the device idled through the commit, the plan and the packing
(~0.8 ms a step against a 1.27 ms device span, H100, trained pair, T = 1, c = 64), while plain
steps ran ahead (llm_engine._step). Here a step N whose rows are every running request's,
each sampling (decode rows, and prompts' last chunks), and which drafts for every row, stays
in flight, and the next step N+1 follows it:

  * N+1 has a decode row of 1 + K tokens for every request still running (all of them N's
    rows: admissions come with schedules, and the requests N's commit ends leave), then new
    requests' prompts as usual; no preemption (`Scheduler.schedule_follow` gives up instead).
  * The host packs each of N's rows from the state before N (`pack_step(follows=True)`): from
    its last known token (position p), its anchor a PENDING_TOKEN, its round N's + 1. The
    device adds e, the tokens N emitted for the row's slot (`last_counts`, written by
    `record_emitted`), to every position, the start and the sequence length, and derives the
    KV slots from the block table again (`follow_inputs`; rows with draft slots are N's,
    prompts have none). The anchor is N's last emitted token (last_tokens) at p + e, the
    drafts those N's drafter wrote to the row's slot: the same inputs as a step scheduled
    after N's commit, so the outputs are the same token for token.
  * Each row's blocks cover N's longest outcome (`follow_extra`: 1 + K tokens) beyond N+1's
    own tokens, and a block table is that much wider (ModelRunner.max_blocks_per_seq).
  * N is committed after N+1's launch; N+1's commit comes after N's, so its tokens append to
    N's. A request that N ends (a stop token, its length limit, an abort) has a wasted row in
    N+1, dropped at its commit; its KV writes land past the request's last computed token, in
    no block the prefix cache holds, and its slot and blocks, freed at N's commit, are used
    again only by steps queued after N+1 on the same stream.
  * A step that cannot follow (blocks or budget short) is scheduled after N is waited for and
    committed, as before.

The lagged plan of N+1 reads the newest confidence copy that has landed and is not N's (as
before; N-1's may still be on its way: three staging buffers, host_copy.py), which keeps it
non-anticipating, and one acceptance check fewer (N's comes at its commit): with trimming its
budgets, and sampled tokens, may differ from a waited-for run's; greedy tokens may not.
Measured on an H100 (demo pair, T = 1): the device's idle time between speculative graph
steps fell from 311-557 us to 1-118 us (median; BENCHMARKS.md, fifty-fourth session). Only
single-process engines with async scheduling follow (DSPARK_FOLLOW=0 turns it off, for A/Bs).
"""

from __future__ import annotations

import os

import torch

from dspark.attention.base import compute_token_to_req

FUSED = os.environ.get("DSPARK_FUSED_OPS", "1") != "0"  # the Triton kernel on CUDA


def follow_enabled() -> bool:
    return os.environ.get("DSPARK_FOLLOW", "1") != "0"


def follow_extra(k: int) -> int:
    """Tokens a following row's blocks cover beyond its packed step: N's longest outcome."""
    return k + 1


def follow_inputs(inp, last_counts: torch.Tensor, block_size: int, follows) -> None:
    """Move every row with draft slots of a step packed from the state before the step in
    flight by the tokens that step emitted for its slot (`follows`: 1 / 0, a Python int or a
    device scalar of a whole-step graph, where the same code serves steps that do not
    follow; rows without draft slots are new requests' prompts, padding rows' have none
    either). Positions, starts and sequence lengths move; KV slots are looked up again;
    padding tokens keep the sentinel slot. Runs before `finalize` (which compacts from
    these)."""
    if inp.positions.is_cuda and FUSED:  # one launch (follow_triton.py)
        from dspark.engine.follow_triton import follow_inputs_triton

        return follow_inputs_triton(inp, last_counts, block_size, follows)
    r = inp.num_reqs
    shift = last_counts[inp.slots] * ((inp.capacities > 0) * follows)  # [R]
    row = compute_token_to_req(inp.query_start_loc, inp.num_tokens).long()
    valid = row < r
    row = row.clamp(max=r - 1)
    pos = inp.positions + torch.where(valid, shift[row], 0)
    tables = inp.block_tables
    block = tables.reshape(-1)[row * tables.shape[1] + pos.div(block_size, rounding_mode="floor")]
    slots = block.long() * block_size + pos.remainder(block_size)
    inp.slot_mapping = torch.where(valid, slots, inp.slot_mapping)
    inp.positions = pos
    inp.start_pos = inp.start_pos + shift
    inp.seq_lens = (inp.seq_lens + shift).to(inp.seq_lens.dtype)
