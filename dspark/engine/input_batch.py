"""Build the one GPU-side input struct of a step from the scheduler's rows.

The CPU lays the step out with every draft slot present (an upper bound: row r gets its
non-draft tokens followed by `capacity_r` draft slots) and ships it in one host->device copy.
Draft token ids are filled in on the device from the per-request draft buffer. When adaptive
verification keeps only `l_r <= capacity_r` drafts of a row, `compact()` rebuilds the ragged
stream on the device (query_start_loc, positions, slots, token->request map) without any host
sync; the CPU keeps only upper bounds (or the exact total when the budget was planned on it).

`pack_step` is the CPU half (numpy only: a HostStep, which tensor-parallel rank 0 broadcasts),
`upload_step` the device half that every rank runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.attention.base import SENTINEL_SLOT, AttentionMetadata, compute_token_to_req
from dspark.engine.scheduler import ScheduledRow
from dspark.sampling.processors import GREEDY_EPS

# input id of a token sampled by the step still in flight (async scheduling): the device
# takes it from the runner's last-sampled-token buffer (`resolve_pending`)
PENDING_TOKEN = -1


@dataclass
class StepInputs:
    # token stream [T]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    # per row [R] (R = scheduled rows)
    query_start_loc: torch.Tensor  # [R+1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_tables: torch.Tensor  # [R, max_blocks] int32
    samples: torch.Tensor  # [R] bool: row ends in a sampled/verified token
    capacities: torch.Tensor  # [R] int64 draft slots laid out for the row
    num_non_draft: torch.Tensor  # [R] int64
    start_pos: torch.Tensor  # [R] int64 position of the row's first new token
    slots: torch.Tensor  # [R] int64 row in the persistent per-request buffers
    seeds: torch.Tensor  # [R] int64
    rounds: torch.Tensor  # [R] int64
    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    # CPU-side facts
    num_reqs: int
    num_tokens: int  # T of the forward (exact or an upper bound with padding at the end)
    max_query_len: int
    max_seq_len: int
    num_samples: int  # rows that sample
    all_greedy: bool
    max_capacity: int
    max_num_logits: int  # logits rows if every draft slot is verified
    short_query_len: int | None = None  # AttentionMetadata.short_query_len (None: the engine's)
    # set by finalize()
    token_to_req: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # [R] int64 verified drafts per row
    cu_num_logits: torch.Tensor | None = None  # [R+1]
    logits_indices: torch.Tensor | None = None  # [N]
    num_logits: int = 0  # N (exact or upper bound)

    @property
    def anchor_pos(self) -> torch.Tensor:
        """Position of each row's anchor (its last non-draft token)."""
        return self.start_pos + self.num_non_draft - 1

    def attn_metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping,
            positions=self.positions,
            token_to_req=self.token_to_req,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            num_reqs=self.num_reqs,
            short_query_len=self.short_query_len,
        )


# Scalars the CPU knows about a step (HostStep.meta), in this order.
META_FIELDS = (
    "num_reqs", "num_tokens", "max_blocks", "max_query_len", "max_seq_len", "num_samples",
    "all_greedy", "max_capacity", "max_num_logits", "any_top_k", "any_top_p", "any_min_p",
    "num_draft_fills", "context_tokens", "follows",
)  # fmt: skip
_META = {name: i for i, name in enumerate(META_FIELDS)}
# what a plan reads of every step (HostStep.plan_scalars)
_PLAN_READS = tuple(_META[k] for k in ("num_reqs", "num_tokens", "num_draft_fills",
                                       "num_samples", "all_greedy", "context_tokens"))


@dataclass
class HostStep:
    """The CPU half of a step: the arrays of the one host->device copy and the CPU-side facts.

    Plain numpy, so that tensor-parallel rank 0 can broadcast it (`payload()`) and every rank
    uploads the same step (`upload_step`).
    """

    meta: np.ndarray  # [len(META_FIELDS)] int64
    ints: np.ndarray  # int64: stream [T] x3, query_start_loc, seq_lens, block tables, per-row
    floats: np.ndarray  # [3, R] float32: temperature, top_p, min_p
    draft_fill: np.ndarray  # [3, n] int64: stream index, draft-buffer row, slot of each draft

    def __post_init__(self) -> None:
        # meta as Python ints, read by name many times a step (the planner, the graph key);
        # meta is never written after packing
        self._scalars = self.meta.tolist()

    def get(self, name: str) -> int:
        return self._scalars[_META[name]]

    def int_sizes(self) -> list[int]:
        return _int_sizes(self.meta)

    def per_row(self) -> np.ndarray:
        """[8, R] int64 views: samples, capacities, non-draft tokens, start position, request
        slot, seed, round, top_k (the tail of `ints`)."""
        r = self.get("num_reqs")
        return self.ints[len(self.ints) - 8 * r :].reshape(8, r)

    def num_draft_slots(self) -> int:
        """Draft slots laid out in the stream (every sampling row's capacity)."""
        return self.get("max_num_logits") - self.get("num_samples")

    def prefill_tokens(self) -> int:
        """Stream tokens beyond one per row and the draft fills: what prefill chunks add."""
        return self.plan_scalars()[2]

    def plan_scalars(self) -> tuple[int, int, int, int, bool, int]:
        """(requests, draft fills, prefill tokens, sampling rows, all greedy, context tokens):
        what the planner reads of every step, in one call."""
        s, (r, t, f, n, g, c) = self._scalars, _PLAN_READS
        return s[r], s[f], s[t] - s[f] - s[r], s[n], bool(s[g]), s[c]

    def forward_tokens(self, budget: int | None) -> int:
        """Tokens the target forward runs on: the packed stream less the draft slots a
        trimmed plan (`budget` drafts verified; None: all) leaves out."""
        slots = self.num_draft_slots()
        return self.get("num_tokens") - slots + (slots if budget is None else min(slots, budget))

    def payload(self) -> np.ndarray:  # one int64 array (floats travel as their bits)
        bits = self.floats.view(np.int32).astype(np.int64).reshape(-1)
        return np.concatenate([self.ints, bits, self.draft_fill.reshape(-1)])

    @classmethod
    def from_payload(cls, meta: np.ndarray, payload: np.ndarray) -> HostStep:
        meta = np.asarray(meta, dtype=np.int64)
        n_ints, r = sum(_int_sizes(meta)), int(meta[_META["num_reqs"]])
        floats = payload[n_ints : n_ints + 3 * r].astype(np.int32).view(np.float32)
        fill = payload[n_ints + 3 * r :].reshape(3, int(meta[_META["num_draft_fills"]]))
        return cls(meta, payload[:n_ints], floats.reshape(3, r), fill)


def _int_sizes(meta: np.ndarray) -> list[int]:
    r, t, b = (int(meta[_META[k]]) for k in ("num_reqs", "num_tokens", "max_blocks"))
    return [t, t, t, r + 1, r, r * b] + [r] * 8


def pack_step(
    rows: list[ScheduledRow], block_tables: np.ndarray, block_size: int, follows: bool = False
) -> HostStep:
    """Host arrays of one step. `block_tables` [R, B] int64: row i is rows[i]'s block table,
    zero past its end (BlockTableMirror.rows). `follows`: the step follows the speculative
    step in flight (follow.py); its rows with draft slots are that step's, packed from the
    state before it: from its last known token, its anchor pending, its round the next one,
    and the device moves its positions (rows without draft slots are new requests' prompts).

    Hot (every step, up to max_num_seqs rows, the host's critical path of a speculative
    step): one Python pass over the rows, then a fixed number of whole-array numpy calls
    writing into the one int64 array that is copied to the device."""
    num_reqs = len(rows)
    # per row: the tail's 8 fields in `per_row()` order, then the row's new tokens and the
    # end of its sequence (for the column maxima); the non-draft tokens in stream order (a
    # row's draft slots follow them: placeholders, filled on the device)
    toks: list[int] = []
    per_row, per_row_f = [], []
    for r in rows:
        req, p = r.req, r.req.params
        s, caps = req.num_computed_tokens, r.num_draft_slots
        nd = r.num_new_tokens - caps
        moved = follows and caps > 0  # (nd = 1: the anchor the step in flight emits last)
        if moved:
            s = req.num_tokens - 1
            toks.append(PENDING_TOKEN)
        else:
            toks += req.token_ids[s : s + nd]
            if req.num_pending and s + nd > len(req.token_ids):  # sampled by the step in
                toks += [PENDING_TOKEN] * (s + nd - max(s, len(req.token_ids)))  # flight
        per_row.append((r.samples, caps, nd, s, req.slot, req.seed, req.round + moved,
                        p.top_k, r.num_new_tokens, s + r.num_new_tokens))  # fmt: skip
        per_row_f.append((p.temperature, p.top_p, p.min_p))
    cols = np.array(per_row, dtype=np.int64).reshape(num_reqs, 10).T
    caps, start, slots, num_new, seq_lens = cols[1], cols[3], cols[4], cols[8], cols[9]
    floats = np.ascontiguousarray(np.array(per_row_f, dtype=np.float32).reshape(num_reqs, 3).T)
    bt = block_tables  # [R, max blocks] (zero past each table's end)
    max_blocks = bt.shape[1]
    num_drafts = int(caps.sum())
    total = len(toks) + num_drafts
    # ints = stream [T] x3 (ids, positions, slot mapping), qsl [R+1], seq_lens [R], block
    # tables [R*B], then the per-row tail [8, R]
    ints = np.empty(3 * total + 2 * num_reqs + 1 + num_reqs * max_blocks + 8 * num_reqs,
                    dtype=np.int64)  # fmt: skip
    positions = ints[total : 2 * total]
    slot_mapping = ints[2 * total : 3 * total]
    o = 3 * total
    qsl = ints[o : o + num_reqs + 1]
    qsl[0] = 0
    np.cumsum(num_new, out=qsl[1:])
    ints[o + num_reqs + 1 : o + 2 * num_reqs + 1] = seq_lens
    o += 2 * num_reqs + 1
    ints[o : o + num_reqs * max_blocks] = bt.reshape(-1)
    ints[o + num_reqs * max_blocks :].reshape(8, num_reqs)[:] = cols[:8]
    # position of token t of row r: start_r + (t - qsl_r); its KV slot from r's block table
    np.add(np.arange(total, dtype=np.int64), np.repeat(start - qsl[:-1], num_new), out=positions)
    block, offset = np.divmod(positions, block_size)
    block += np.repeat(np.arange(0, num_reqs * max_blocks, max_blocks), num_new)
    np.multiply(bt.reshape(-1)[block], block_size, out=slot_mapping)
    slot_mapping += offset
    fill = np.zeros((3, num_drafts), dtype=np.int64)
    if num_drafts:  # draft slots [anchor, d_1..d_c] are filled from the device draft buffer
        first = np.cumsum(caps) - caps  # index of each row's first draft among all drafts
        idx = np.arange(num_drafts, dtype=np.int64)
        fill[2] = idx - np.repeat(first, caps)  # the draft's index k within its row
        fill[0] = fill[2] + np.repeat(qsl[1:] - caps, caps)  # the row's slots close its query
        fill[1] = np.repeat(slots, caps)
        non_draft = np.ones(total, dtype=bool)
        non_draft[fill[0]] = False
        ints[:total] = 0
        ints[:total][non_draft] = toks
    else:
        ints[:total] = toks
    # column maxima in one call; temperature / top_p / min_p extremes in one call each
    hi = cols.max(axis=1) if num_reqs else np.zeros(10, dtype=np.int64)
    fmax = floats.max(axis=1) if num_reqs else np.zeros(3, dtype=np.float32)
    fmin = floats.min(axis=1) if num_reqs else np.ones(3, dtype=np.float32)
    samples = cols[0]
    num_samples = int(samples.sum())
    meta = np.array([
        num_reqs, total, max_blocks, hi[8], hi[9], num_samples, bool(fmax[0] <= GREEDY_EPS),
        hi[1], num_samples + int(samples @ caps), hi[7] > 0, bool(fmin[1] < 1),
        bool(fmax[2] > 0), num_drafts, int(start.sum()),  # (the rows' contexts, summed)
        follows,
    ], dtype=np.int64)  # fmt: skip
    return HostStep(meta, ints, floats, fill)


def upload_step(
    host: HostStep,
    device: torch.device,
    draft_tokens: torch.Tensor | None,  # [S, K] persistent draft buffer on the device
) -> StepInputs:
    num_reqs, max_blocks = host.get("num_reqs"), host.get("max_blocks")
    packed = torch.from_numpy(host.ints)
    floats = torch.from_numpy(host.floats)
    if device.type == "cuda":
        packed, floats = packed.pin_memory(), floats.pin_memory()
    packed = packed.to(device, non_blocking=True)  # the one host->device copy of the step
    floats = floats.to(device, non_blocking=True)
    (ids, pos, slots_map, qsl_t, seq_lens, bt_t, samples_t, caps_t, nd_t, start_t, slot_t,
     seeds_t, rounds_t, top_k_t) = packed.split(host.int_sizes())  # fmt: skip
    if draft_tokens is not None and host.draft_fill.shape[1]:
        idx = torch.from_numpy(host.draft_fill).to(device, non_blocking=True)
        ids = ids.clone()
        ids[idx[0]] = draft_tokens[idx[1], idx[2]]
    return StepInputs(
        input_ids=ids,
        positions=pos,
        slot_mapping=slots_map,
        query_start_loc=qsl_t.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=bt_t.view(num_reqs, max_blocks).to(torch.int32),
        samples=samples_t.bool(),
        capacities=caps_t,
        num_non_draft=nd_t,
        start_pos=start_t,
        slots=slot_t,
        seeds=seeds_t,
        rounds=rounds_t,
        temperature=floats[0],
        top_k=top_k_t if host.get("any_top_k") else None,
        top_p=floats[1] if host.get("any_top_p") else None,
        min_p=floats[2] if host.get("any_min_p") else None,
        num_reqs=num_reqs,
        num_tokens=host.get("num_tokens"),
        max_query_len=host.get("max_query_len"),
        max_seq_len=host.get("max_seq_len"),
        num_samples=host.get("num_samples"),
        all_greedy=bool(host.get("all_greedy")),
        max_capacity=host.get("max_capacity"),
        max_num_logits=host.get("max_num_logits"),
    )


def finalize(
    inp: StepInputs, lengths: torch.Tensor | None, num_tokens: int | None, num_logits: int | None
) -> None:
    """Fix the verified drafts per row and derive the ragged stream and logits rows.

    lengths None: every draft slot is verified (no compaction). Otherwise the stream is
    compacted on the device to `num_tokens` tokens (exact, or an upper bound: the tail is
    padding that writes to the sentinel slot) and `num_logits` logits rows.
    """
    device = inp.input_ids.device
    if lengths is None:
        inp.lengths = inp.capacities
        inp.token_to_req = compute_token_to_req(inp.query_start_loc, inp.num_tokens)
        n_logits = inp.samples.long() * (1 + inp.capacities)
    else:
        inp.lengths = lengths
        q_len = inp.num_non_draft + lengths
        qsl = torch.zeros(inp.num_reqs + 1, dtype=torch.int64, device=device)
        qsl[1:] = q_len.cumsum(0)
        t = num_tokens if num_tokens is not None else inp.num_tokens
        token_to_req = compute_token_to_req(qsl, t)
        valid = token_to_req < inp.num_reqs
        r = token_to_req.long().clamp(max=inp.num_reqs - 1)
        src = inp.query_start_loc.long()[r] + (torch.arange(t, device=device) - qsl[r])
        src = torch.where(valid, src, torch.zeros_like(src))
        inp.input_ids = torch.where(valid, inp.input_ids[src], 0)
        inp.positions = torch.where(valid, inp.positions[src], 0)
        inp.slot_mapping = torch.where(valid, inp.slot_mapping[src], SENTINEL_SLOT)
        inp.query_start_loc = qsl.to(torch.int32)
        inp.seq_lens = (inp.start_pos + q_len).to(torch.int32)
        inp.token_to_req = token_to_req
        inp.num_tokens = t
        n_logits = inp.samples.long() * (1 + lengths)
    cu = torch.zeros(inp.num_reqs + 1, dtype=torch.int64, device=device)
    cu[1:] = n_logits.cumsum(0)
    inp.cu_num_logits = cu
    if num_logits is None:
        num_logits = inp.max_num_logits  # every draft slot of every sampling row
    inp.num_logits = num_logits
    tl = torch.arange(num_logits, device=device)
    r = (torch.searchsorted(cu, tl, right=True) - 1).clamp(max=inp.num_reqs - 1)
    local = tl - cu[r]
    qsl_end = inp.query_start_loc.long()[r + 1]
    idx = qsl_end - n_logits[r] + local
    inp.logits_indices = torch.where(tl < cu[-1], idx, torch.zeros_like(idx))


def resolve_pending(inp: StepInputs, last_tokens: torch.Tensor) -> None:
    """Replace every PENDING_TOKEN input of a finalized step with the token its request's
    slot emitted last (written by an earlier step on the same stream). Other ids (prompt
    tokens, drafts) are untouched; padding tokens map to a real row but are never pending."""
    row = inp.token_to_req.long().clamp(max=max(inp.num_reqs - 1, 0))
    ids = inp.input_ids
    inp.input_ids = torch.where(ids == PENDING_TOKEN, last_tokens[inp.slots[row]], ids)


def record_emitted(last_tokens: torch.Tensor, inp: StepInputs, out: torch.Tensor,
                   num_out: torch.Tensor, last_counts: torch.Tensor | None = None) -> None:
    """last_tokens[slot] = the last token each sampling row emitted (out [R, W], num_out
    [R]; slots distinct, padding rows on the scratch slot), for resolve_pending; and, given
    `last_counts`, last_counts[slot] = how many it emitted (for a following step:
    follow.py)."""
    last = out.gather(1, (num_out.long() - 1).clamp(min=0)[:, None])[:, 0]
    emitted = inp.samples & (num_out > 0)
    last_tokens[inp.slots] = torch.where(emitted, last, last_tokens[inp.slots])
    if last_counts is not None:
        last_counts[inp.slots] = torch.where(emitted, num_out.long(), last_counts[inp.slots])
