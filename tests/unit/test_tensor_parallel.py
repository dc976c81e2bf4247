"""Tensor parallelism on the CPU: 2 processes over gloo.

Layers: each parallel layer, sharded over 2 ranks and fed the full weights through its
weight_loader, equals the unsharded computation. Engine: greedy outputs at
tensor_parallel_size=2 equal those at 1, with speculation and lagged adaptive verification on
(and DSPARK_TP_CHECK=1, so every step also checks that both ranks computed the same verify
output, verify lengths and drafts). Worker processes never outlive a test.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dspark import LLM, SamplingParams
from dspark.layers.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    tensor_parallel,
)
from dspark.models.qwen3 import MLP
from dspark.spec.cost_model import CostModel
from dspark.testing.drafters import make_tiny_drafter

WORLD = 2


# --------------------------------------------------------------------------- layers
def _load(layer, weights: dict) -> None:
    """Full (unsharded) tensors -> this rank's shards, through the layers' loaders."""
    with torch.no_grad():
        for name, parts in weights.items():
            param = getattr(layer, name)
            if isinstance(parts, list):
                for i, t in enumerate(parts):
                    layer.weight_loader(param, t, i)
            else:
                layer.weight_loader(param, parts, None)


def _layer_errors(rank: int) -> dict[str, float]:
    tp = TPGroup(rank, WORLD, dist.group.WORLD)
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731 - same on both ranks
    errs = {}
    x = rnd(5, 16)
    # packed q/k/v by heads: 4 query heads, 2 kv heads, head_dim 4 -> 2 and 1 per rank
    w, b = [rnd(16, 16), rnd(8, 16), rnd(8, 16)], [rnd(16), rnd(8), rnd(8)]
    with tensor_parallel(tp):
        qkv = QKVParallelLinear(16, 4, 4, 2, bias=True)
    _load(qkv, {"weight": w, "bias": b})
    q, k, v = (F.linear(x, wi, bi) for wi, bi in zip(w, b))
    want = torch.cat([q[:, rank * 8 : rank * 8 + 8], k[:, rank * 4 : rank * 4 + 4],
                      v[:, rank * 4 : rank * 4 + 4]], dim=1)  # fmt: skip
    errs["qkv"] = (qkv(x) - want).abs().max().item()
    # plain column split
    w1 = rnd(10, 16)
    with tensor_parallel(tp):
        col = ColumnParallelLinear(16, 10, bias=False)
    _load(col, {"weight": w1})
    errs["column"] = (col(x) - F.linear(x, w1)[:, rank * 5 : rank * 5 + 5]).abs().max().item()
    # row split + all-reduce (+ bias once)
    x_in, w2, b2 = rnd(5, 12), rnd(16, 12), rnd(16)
    with tensor_parallel(tp):
        row = RowParallelLinear(12, 16, bias=True)
    _load(row, {"weight": w2, "bias": b2})
    got = row(x_in[:, rank * 6 : rank * 6 + 6])
    errs["row"] = (got - F.linear(x_in, w2, b2)).abs().max().item()
    # merged gate/up column + row: the SwiGLU MLP of the models
    cfg = SimpleNamespace(hidden_size=16, intermediate_size=12, mlp_bias=False)
    gate, up, down = rnd(12, 16), rnd(12, 16), rnd(16, 12)
    with tensor_parallel(tp):
        mlp = MLP(cfg)
    _load(mlp.gate_up_proj, {"weight": [gate, up]})
    _load(mlp.down_proj, {"weight": down})
    want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    errs["mlp"] = (mlp(x) - want).abs().max().item()
    # vocab-parallel embedding and LM head with a vocabulary that 2 does not divide
    table, ids = rnd(37, 16), torch.tensor([[0, 18, 19, 36], [5, 36, 20, 1]])
    with tensor_parallel(tp):
        emb = VocabParallelEmbedding(37, 16)
        head = ParallelLMHead(37, 16)
    _load(emb, {"weight": table})
    _load(head, {"weight": table})
    errs["embedding"] = (emb(ids) - F.embedding(ids, table)).abs().max().item()
    h = rnd(2, 3, 16)
    logits = head(h)
    assert logits.shape == (2, 3, 37)
    errs["lm_head"] = (logits - F.linear(h, table)).abs().max().item()
    return errs


def _layer_worker(rank: int, init_file: str, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=WORLD)  # fmt: skip
        with torch.inference_mode():
            results.put((rank, _layer_errors(rank)))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_parallel_layers_match_unsharded(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_layer_worker, args=(r, str(tmp_path / "store"), results),
                         daemon=True) for r in range(WORLD)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + 60
        while len(got) < WORLD and time.monotonic() < deadline:
            if results.empty():
                assert all(p.is_alive() or p.exitcode == 0 for p in procs), "a rank crashed"
                time.sleep(0.05)
                continue
            rank, res = results.get()
            got[rank] = res
        assert len(got) == WORLD, "the ranks did not finish in time"
        for rank, res in got.items():
            assert isinstance(res, dict), f"rank {rank} failed:\n{res}"
            assert set(res) == {"qkv", "column", "row", "mlp", "embedding", "lm_head"}
            bad = {k: v for k, v in res.items() if not v < 1e-5}
            assert not bad, f"rank {rank}: sharded layers differ from unsharded ones: {bad}"
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def test_indivisible_shapes_are_rejected(ckpt_dir):
    children = set(multiprocessing.active_children())
    with tensor_parallel(TPGroup(0, 2, None)):  # construction needs no process group
        with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide .*heads \(3\)"):
            QKVParallelLinear(48, 16, 3, 3)
        with pytest.raises(ValueError, match="intermediate_size"):
            MLP(SimpleNamespace(hidden_size=16, intermediate_size=15, mlp_bias=False))
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(ckpt_dir("qwen3_gqa2"), device="cpu", tensor_parallel_size=0)
    # 3 query and 3 kv heads: refused before any worker is started
    with pytest.raises(ValueError, match=r"must divide the target's num_attention_heads \(3\)"):
        LLM(ckpt_dir("qwen3_mha_oddhead"), device="cpu", tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == children
    assert not dist.is_initialized()


def test_single_rank_layers_are_plain():
    assert SINGLE.size == 1 and SINGLE.group is None
    row = RowParallelLinear(8, 4)
    assert row.tp is SINGLE and row.weight.shape == (4, 8)
    x = torch.randn(3, 8)
    assert torch.equal(row(x), F.linear(x, row.weight, row.bias))


# --------------------------------------------------------------------------- engine
PROMPTS = [list(range(40, 72)) + [1, 2], [5, 6, 7], list(range(100, 141)),
           list(range(40, 72)) + [9], [3] * 11]  # fmt: skip
ENGINE_ARGS = dict(device="cpu", block_size=4, max_num_batched_tokens=24, num_kv_blocks=30)


@pytest.fixture(scope="module")
def spec_config(tiny_qwen, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    drafter = make_tiny_drafter(str(root / "drafter"), tiny_qwen, seed=7)
    cost = str(root / "cost.json")
    # expensive tokens: the lagged planner trims some drafts, not all
    CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.2).to_json(cost)
    return {"model": drafter, "num_speculative_tokens": 3, "adaptive_policy": "lagged",
            "cost_table_path": cost}  # fmt: skip


def _generate(llm):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    llm.engine.block_manager.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


def test_tp2_greedy_identity_with_adaptive_verification(tiny_qwen, spec_config, monkeypatch):
    reference = _generate(LLM(tiny_qwen, speculative_config=spec_config, **ENGINE_ARGS))
    monkeypatch.setenv("DSPARK_TP_CHECK", "1")  # ranks compare their results every step
    llm = LLM(tiny_qwen, speculative_config=spec_config, tensor_parallel_size=2, **ENGINE_ARGS)
    procs = list(llm.engine.runner.world.procs)
    try:
        assert [p.is_alive() for p in procs] == [True]
        got = _generate(llm)
        stats = llm.engine.spec_stats
        preemptions = llm.engine.stats["preemptions"]
    finally:
        llm.shutdown()
    assert got == reference
    assert 0 < stats.num_verified_tokens < stats.num_drafted_tokens, "adaptive trimming is off"
    assert preemptions > 0, "the tiny KV cache should force preemption"
    assert [p.exitcode for p in procs] == [0], "workers should stop cleanly on shutdown"
    assert not dist.is_initialized()
    llm.shutdown()  # idempotent


def test_tp2_without_speculation_then_worker_death(tiny_qwen):
    reference = _generate(LLM(tiny_qwen, **ENGINE_ARGS))
    llm = LLM(tiny_qwen, tensor_parallel_size=2, **ENGINE_ARGS)
    proc = llm.engine.runner.world.procs[0]
    try:
        assert _generate(llm) == reference
        # a signal to the whole process group (Ctrl-C; systemd stopping a unit) leaves the
        # workers to rank 0, which shuts them down (or they exit when it is gone)
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(proc.pid, sig)
        time.sleep(0.5)
        assert proc.is_alive() and _generate(llm) == reference
        proc.kill()  # a dead rank fails the next step instead of hanging it
        proc.join(10)
        # (before any collective: gloo once let a broadcast to the dead rank wait out the
        # group's 10-minute timeout)
        with pytest.raises(RuntimeError, match=f"worker {proc.name} exited with code -9"):
            _generate(llm)
    finally:
        llm.shutdown()
    assert not proc.is_alive() and not dist.is_initialized()


_RANK0 = """
import sys, torch
from dspark import LLM
llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, num_kv_blocks=16)
print(llm.engine.runner.world.procs[0].pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_workers_exit_when_rank0_is_killed(tiny_qwen, tmp_path):
    log = open(tmp_path / "rank0.log", "w+")  # closed below
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_RANK0), tiny_qwen],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)  # fmt: skip
    worker = None
    try:
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            log.seek(0)
            pytest.fail(f"rank 0 did not start:\n{log.read()}")
        worker = int(line)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "a worker outlived rank 0"
    finally:
        proc.kill()
        proc.wait()
        log.close()
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
