"""Without flash-decoding splits (DSPARK_ATTENTION_SPLITS=0), a decode row's attention is the
same bits whatever step it rides in: alone, as the first row of a verify tile of 1 + K
tokens, or beside a prefill chunk (the two-launch plan). This is what keeps bf16 greedy
outputs with and without speculation identical where near-ties would otherwise flip. (With
splits, whether and how a row splits depends on the step: the batch size, the longest
context, a prefill beside it. The forty-seventh session's H100 sweep saw 68 of 4,096 prompts
part from no-spec at C = 4-32, where steps split, and none at C = 1 or C >= 64.)"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from dspark.attention import select_backend  # noqa: E402
from dspark.attention.base import AttentionMetadata, compute_token_to_req  # noqa: E402
from dspark.attention.triton import launch_config  # noqa: E402
from dspark.attention.triton import paged_attention as pa  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16
VERIFY = 8  # 1 + K
# (heads, KV heads, head_dim, position): the interpreter's small case everywhere; on a GPU also
# the 8B shape's heads at a 700-token context (its verify tile is 32 rows, the decode tile 16)
SHAPES = [(4, 2, 16, p) for p in (5, 37, 70)] + (
    [(32, 8, 128, 700)] if torch.cuda.is_available() else [])


def _metadata(rows: list[tuple[int, int, int]], tables: torch.Tensor) -> AttentionMetadata:
    """rows: (table row, first position, query tokens) per request, in step order."""
    cu, positions = [0], []
    for _, p0, n in rows:
        cu.append(cu[-1] + n)
        positions += range(p0, p0 + n)
    cu_q = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    seq_lens = [p0 + n for _, p0, n in rows]
    return AttentionMetadata(
        query_start_loc=cu_q,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables[[t for t, _, _ in rows]],
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device=DEVICE),  # (not written)
        positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE),
        token_to_req=compute_token_to_req(cu_q, cu[-1]),
        max_query_len=max(n for _, _, n in rows), max_seq_len=max(seq_lens),
        num_reqs=len(rows), short_query_len=VERIFY,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,position", SHAPES)
def test_a_rows_attention_is_the_same_bits_in_every_step_it_can_ride_in(
        monkeypatch, dtype, heads, kv_heads, head_dim, position):  # fmt: skip
    monkeypatch.setenv("DSPARK_ATTENTION_SPLITS", "0")
    backend = select_backend("triton", torch.device(DEVICE))
    assert backend.max_splits == 1  # (and 16 without the variable: the next test)
    gen = torch.Generator().manual_seed(position)
    prefill = 48  # a prompt's chunk: its tile is >= 4x the verify tile, so two launches
    blocks = -(-(position + VERIFY) // PAGE) + -(-prefill // PAGE)
    cache_shape = (blocks + 1, PAGE, kv_heads, head_dim)
    k_cache = torch.randn(*cache_shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(*cache_shape, generator=gen).to(dtype).to(DEVICE)
    perm = (torch.randperm(blocks, generator=gen) + 1).to(torch.int32)  # (block 0: sentinel)
    tables = torch.zeros(2, blocks, dtype=torch.int32)
    tables[0, : blocks - 3], tables[1, :3] = perm[: blocks - 3], perm[blocks - 3 :]
    tables = tables.to(DEVICE)
    q_row = torch.randn(1, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    others = torch.randn(prefill + VERIFY, heads, head_dim, generator=gen).to(dtype).to(DEVICE)

    def attend(rows, q):
        return backend.attend(q, k_cache, v_cache, _metadata(rows, tables), head_dim**-0.5)

    alone = attend([(0, position, 1)], q_row)
    verify = attend([(0, position, VERIFY)], torch.cat([q_row, others[: VERIFY - 1]]))
    md = _metadata([(1, 0, prefill), (0, position, 1)], tables)
    group_pad = 1 << (heads // kv_heads - 1).bit_length()
    plan = launch_config.launch_plan(group_pad, md.max_query_len, head_dim, DEVICE == "cuda",
                                     VERIFY)  # fmt: skip
    assert [launch.pass_ for launch in plan] == [2, 1]  # (the prefill's launch, then the row's)
    beside_prefill = attend([(1, 0, prefill), (0, position, 1)], torch.cat([others[:prefill],
                                                                            q_row]))  # fmt: skip
    assert torch.isfinite(alone).all() and alone.abs().sum() > 0
    assert torch.equal(verify[:1], alone)
    assert torch.equal(beside_prefill[prefill:], alone)


def test_splits_are_on_unless_the_variable_turns_them_off(monkeypatch):
    monkeypatch.delenv("DSPARK_ATTENTION_SPLITS", raising=False)
    assert select_backend("triton", torch.device(DEVICE)).max_splits == 16
    monkeypatch.setenv("DSPARK_ATTENTION_SPLITS", "off")
    assert select_backend("triton", torch.device(DEVICE)).max_splits == 1


def test_with_splits_the_same_rows_bits_depend_on_the_step(monkeypatch):
    """Why the variable exists: the check above fails once the decode step alone splits its
    keys (as a GPU's does when few programs meet a long context) while the row's launch beside
    a prefill does not (the short launch never splits)."""
    monkeypatch.setattr(launch_config, "pick_num_splits", lambda *args: 4)
    monkeypatch.setattr(pa, "pick_num_splits", lambda *args: 4)
    with pytest.raises(AssertionError, match="equal"):
        test_a_rows_attention_is_the_same_bits_in_every_step_it_can_ride_in(
            monkeypatch, torch.bfloat16, 4, 2, 16, 70)
