"""Paged KV-cache block manager: reference counts, prefix caching, integrity checks.

Blocks are fixed-size groups of `block_size` token slots in one preallocated cache. Block 0
is the sentinel: never handed out, padding tokens write into it.

Prefix caching: a full block is identified by a chained hash of (previous block's hash, its
token ids, the request's cache_salt). Blocks whose reference count drops to zero stay cached
(evictable, least recently freed first) until their slot is needed. Only blocks whose every
token is committed *and* computed are registered, so a block holding rolled-back draft
positions is never shared.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from dspark.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is the sentinel)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(1, num_blocks)
        )
        self.hash_to_block: dict[int, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[int]] = {}  # hashes of a request's registered blocks
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # tokens found

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def blocks_needed(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def _chain_hash(self, parent: int | None, req: Request, i: int) -> int:
        tokens = tuple(req.token_ids[i * self.block_size : (i + 1) * self.block_size])
        # the salt keys the first block; every later hash inherits it through the chain
        return hash((parent, tokens, req.cache_salt if parent is None else None))

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding a cached prefix of req (no references taken). At least one token is
        always left to compute, so the last prompt token's logits can be produced."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[int] = []
        parent = None
        for i in range(max_blocks):
            h = self._chain_hash(parent, req, i)
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
            parent = h
        self.num_prefix_queries += req.num_tokens
        self.num_prefix_hits += len(hits) * bs
        return hits

    # -- allocation --------------------------------------------------------------------------
    def allocate(
        self, req: Request, num_slots: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Make req's block table cover `num_slots` token slots. On the first call
        `cached_blocks` (from find_cached_prefix) are shared. Returns False, changing nothing,
        when there are not enough free blocks."""
        table = self.block_tables.get(req.request_id)
        if table is not None and len(table) * self.block_size >= num_slots:
            return True  # the hot case: a running request whose blocks already cover it
        cached = cached_blocks or []
        have = len(table) if table is not None else len(cached)
        need = self.blocks_needed(num_slots) - have
        # cached blocks currently in the free list are taken out of it, so count them
        reclaimed = sum(1 for b in cached if self.ref_counts[b] == 0) if table is None else 0
        if need > self.num_free_blocks - reclaimed:
            return False
        if table is None:
            table = []
            for b in cached:
                if self.ref_counts[b] == 0:
                    del self.free_blocks[b]
                self.ref_counts[b] += 1
                table.append(b)
            self.block_tables[req.request_id] = table
            self.block_hashes[req.request_id] = [self.block_hash[b] for b in cached]
            req.num_hashed_blocks = len(cached)
        for _ in range(max(0, need)):
            block, _ = self.free_blocks.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:  # evict a cached block
                if self.hash_to_block.get(old) == block:
                    del self.hash_to_block[old]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            table.append(block)
        return True

    def free(self, req: Request) -> None:
        table = self.block_tables.pop(req.request_id, None)
        self.block_hashes.pop(req.request_id, None)
        req.num_hashed_blocks = 0
        if table is None:
            return
        for block in reversed(table):  # tail blocks become the first to be evicted
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None

    def cache_full_blocks(self, req: Request) -> None:
        """Register req's blocks that are full of committed, computed tokens. Hot (every
        request, every step): one that fills no block past those registered
        (req.num_hashed_blocks: len(block_hashes[id])) returns at the second test; the
        lookups below cost ~0.9 µs a call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens, len(req.token_ids)) // bs  # committed only
        if req.context_gap is not None:  # (a block lends its drafter context with its KV: none
            num_full = min(num_full, req.context_gap // bs)  # whose context is missing)
        if num_full <= req.num_hashed_blocks:
            return
        table = self.block_tables.get(req.request_id)
        if table is None:
            return
        hashes = self.block_hashes[req.request_id]
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            h = self._chain_hash(parent, req, i)
            block = table[i]
            hashes.append(h)
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.hash_to_block[h] = block
            parent = h
        req.num_hashed_blocks = len(hashes)

    def block_table(self, req: Request) -> list[int]:
        return self.block_tables.get(req.request_id, [])

    # -- invariants --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken."""
        counts = [0] * self.num_blocks
        for rid, table in self.block_tables.items():
            assert len(set(table)) == len(table), f"request {rid} holds a block twice"
            for b in table:
                assert 0 < b < self.num_blocks, f"request {rid} holds invalid block {b}"
                counts[b] += 1
        assert counts == self.ref_counts, "reference counts do not match the block tables"
        assert 0 not in self.free_blocks and self.ref_counts[0] == 0, "sentinel block in use"
        for b in range(1, self.num_blocks):
            in_free = b in self.free_blocks
            assert in_free == (self.ref_counts[b] == 0), f"block {b} free-list state is wrong"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash map entry of block {b} is stale"
        for rid, hashes in self.block_hashes.items():
            assert len(hashes) <= len(self.block_tables[rid]), f"request {rid} hash overflow"


class BlockTableMirror:
    """numpy copy of the running requests' block tables, one row per request slot, kept up
    to date incrementally: a step copies only the blocks appended since the last one (tables
    only grow while a request holds its blocks; freeing and re-admission create a new list,
    which rewrites the row). Building every table from the Python lists each step costs
    O(all blocks) per step, milliseconds at hundreds of long requests."""

    def __init__(self, manager: BlockManager, num_slots: int, max_blocks: int):
        self.manager = manager
        self.table = np.zeros((num_slots, max_blocks), dtype=np.int64)
        self.lens = np.zeros(num_slots, dtype=np.int64)
        self.owner: list[list[int] | None] = [None] * num_slots

    def rows(self, reqs: list[Request]) -> np.ndarray:
        """[R, max blocks among reqs] int64 block tables of reqs (by their slots)."""
        slots = np.fromiter((r.slot for r in reqs), dtype=np.int64, count=len(reqs))
        for req, s in zip(reqs, slots.tolist()):
            ids = self.manager.block_table(req)
            n, have = len(ids), int(self.lens[s])
            if self.owner[s] is not ids or n < have:  # another table now: rewrite the row
                self.table[s, :have] = 0  # (past a table's end the row stays zero)
                self.owner[s], have = ids, 0
            if n > self.table.shape[1]:  # (not expected: tables are sized for max_model_len)
                self.table = np.pad(self.table, ((0, 0), (0, n - self.table.shape[1])))
            if n > have:
                self.table[s, have:n] = ids[have:n]
            self.lens[s] = n
        width = max(1, int(self.lens[slots].max())) if len(reqs) else 1
        return self.table[slots, :width]
