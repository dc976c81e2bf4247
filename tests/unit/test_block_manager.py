"""Block manager bookkeeping under a randomized schedule with aborts and preemptions."""

import random

import pytest

from dspark import LLM, SamplingParams
from dspark.engine.block_manager import BlockManager
from dspark.engine.request import Request


def _req(rid, tokens, salt=None):
    return Request(rid, tokens, SamplingParams(), [], seed=0, cache_salt=salt)


def test_prefix_cache_sharing_salt_and_eviction():
    bm = BlockManager(num_blocks=9, block_size=4)
    a = _req("a", list(range(13)))
    assert bm.allocate(a, 13, bm.find_cached_prefix(a))
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    b = _req("b", list(range(12)) + [99, 98])
    hit = bm.find_cached_prefix(b)
    assert hit == bm.block_table(a)[:3]
    assert bm.allocate(b, 14, hit)
    assert bm.ref_counts[hit[0]] == 2
    salted = _req("c", list(range(13)), salt="tenant-2")
    assert bm.find_cached_prefix(salted) == []  # another tenant never shares blocks
    bm.check_integrity()
    bm.free(a)
    bm.free(b)
    bm.check_integrity()
    assert bm.num_free_blocks == 8
    # cached blocks survive until their slots are needed, then are evicted
    d = _req("d", list(range(13)))
    assert len(bm.find_cached_prefix(d)) == 3
    big = _req("e", [7] * 32)
    assert bm.allocate(big, 32)
    assert bm.find_cached_prefix(d) == []
    bm.check_integrity()
    assert not bm.allocate(_req("f", [1]), 5)  # all 8 blocks in use: refused, nothing changed
    bm.check_integrity()


def test_never_hits_the_whole_prompt():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(8)))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    same = _req("b", list(range(8)))
    assert len(bm.find_cached_prefix(same)) == 1  # the last token must still be computed


@pytest.mark.parametrize("seed,ahead", [(0, True), (1, True), (0, False)])
def test_randomized_schedule_keeps_integrity(tiny_qwen, seed, ahead):
    """`ahead`: async scheduling (a step in flight at every check) or not (each step
    committed when step() returns: every full committed block is registered then)."""
    rnd = random.Random(seed)
    llm = LLM(
        tiny_qwen, device="cpu", block_size=4, num_kv_blocks=20, max_num_seqs=6,
        max_num_batched_tokens=24, async_scheduling=ahead,
    )  # fmt: skip
    engine = llm.engine
    bm = engine.block_manager
    live, n_added, n_aborted, finished, settled = [], 0, 0, 0, 0
    shared = [rnd.randrange(384) for _ in range(8)]
    for step in range(160):
        if n_added < 30 and rnd.random() < 0.4:
            prompt = (shared if rnd.random() < 0.5 else []) + [
                rnd.randrange(384) for _ in range(rnd.randint(1, 14))
            ]
            rid = f"r{n_added}"
            params = SamplingParams(
                temperature=rnd.choice([0.0, 1.0]), max_tokens=rnd.randint(1, 25), seed=step,
                ignore_eos=True,
            )  # fmt: skip
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            live.append(rid)
            n_added += 1
        if live and rnd.random() < 0.08:
            victim = live.pop(rnd.randrange(len(live)))
            engine.abort_request(victim)
            n_aborted += 1
        for out in engine.step():
            if out.finished:
                finished += 1
                live.remove(out.request_id)
                assert len(out.outputs[0].token_ids) <= 25
        bm.check_integrity()
        for req in engine.scheduler.running:  # the request's count of its registered blocks
            hashes = bm.block_hashes.get(req.request_id, [])  # (and with no step in flight,
            assert req.num_hashed_blocks == len(hashes)  # every full committed block)
            if engine._in_flight is None:
                settled += 1
                assert len(hashes) == min(req.num_computed_tokens, len(req.token_ids)) // 4
        if not engine.has_unfinished_requests() and n_added >= 30:
            break
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished += 1
        bm.check_integrity()
    assert finished + n_aborted == n_added
    assert engine.stats["preemptions"] > 0
    assert bm.num_free_blocks == bm.num_blocks - 1  # nothing leaked
    assert settled > 10 or ahead, settled  # (requests checked with no step in flight)


def test_block_table_mirror_matches_the_tables_through_reuse():
    """The incremental numpy mirror equals the block manager's lists (zero-padded) after every
    change: growth, frees, slots reused by other requests, a request re-admitted into its old
    slot with a new table (as after preemption)."""
    import numpy as np

    from dspark.engine.block_manager import BlockTableMirror

    rng = random.Random(3)
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    mirror = BlockTableMirror(bm, num_slots=4, max_blocks=4)  # rows grow past 4 blocks too
    live: dict[int, Request] = {}
    counter = 0
    for _ in range(400):
        slot = rng.randrange(4)
        req = live.get(slot)
        action = rng.random()
        if req is None or action < 0.15:  # (re)admit: a fresh table in this slot
            if req is not None:
                bm.free(req)
            if req is None or rng.random() < 0.5:
                counter += 1
                req = _req(f"r{counter}", [1, 2, 3])
            req.slot = slot
            live[slot] = req
            assert bm.allocate(req, rng.randint(1, 8))
        elif action < 0.9:  # grow
            have = len(bm.block_table(req)) * 4
            if not bm.allocate(req, have + rng.randint(1, 6)):
                continue
        reqs = list(live.values())
        rng.shuffle(reqs)
        got = mirror.rows(reqs)
        width = max(len(bm.block_table(r)) for r in reqs)
        want = np.zeros((len(reqs), max(width, 1)), dtype=np.int64)
        for i, r in enumerate(reqs):
            t = bm.block_table(r)
            want[i, : len(t)] = t
        assert np.array_equal(got, want)
