"""Tensor parallelism: one process per rank, rank 0 is the engine process.

Start-up (rank 0, from `ModelRunner`): check that N divides every sharded dimension, open a
TCP store on 127.0.0.1 (a free port), spawn ranks 1..N-1 ('spawn' context, daemonic), wait
until each has connected (a worker that dies first is reported with its traceback), then
join the process group: NCCL on CUDA (rank r on cuda:base+r) plus a gloo group for host
messages, gloo alone on the CPU. Every rank then builds the same ModelRunner in lockstep:
weights sharded on load, the KV-cache size agreed by all-reduce(min), the cost table
profiled by all ranks together (its forwards contain collectives) with rank 0's
measurement broadcast (or rank 0's file broadcast).

Step protocol (rank 0 is authoritative for every decision):

    rank 0   schedule, plan (budget from its stale host confidences), pack_step
             -> broadcast header [op, has_budget, budget, payload_len, 0, meta] and one
                int64 payload (the HostStep arrays) over the gloo group
    all      upload_step (own host->device copy) -> choose_lengths (device, from confidences
             that rank 0 broadcast last step) -> target forward (all-reduce per layer,
             all-gather of logits) -> verify (identical logits, identical RNG keys)
             -> broadcast rank 0's emitted tokens -> drafter propose
             -> broadcast rank 0's drafts and confidences of the step's rows
    rank 0   copies the emitted tokens to the host and returns them to the engine

Every tensor shape in a collective follows from the broadcast host arrays, so ranks cannot
disagree on a collective; the two small device broadcasts make the next step's inputs
(draft tokens, verify lengths) rank 0's even if a kernel were not bitwise reproducible
across GPUs. DSPARK_TP_CHECK=1 also compares every rank's own verify result, lengths and
drafts with rank 0's at each step (a host sync; for tests and bring-up).

Shutdown: op SHUTDOWN, join with a timeout, then terminate/kill. A worker exits when rank 0
dies (parent watchdog) or a collective fails. Every process sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before touching CUDA/NCCL.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from dspark.engine.input_batch import META_FIELDS, HostStep
from dspark.layers.parallel import TPGroup

logger = logging.getLogger(__name__)

MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
OP_STEP, OP_PROFILE, OP_SHUTDOWN = 1, 2, 3
HEADER_LEN = 5 + len(META_FIELDS)
_READY_KEY = "dspark_tp_ready_{}"


def _timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("DSPARK_TP_TIMEOUT_S", "600")))


def check_tensor_parallel_shapes(model_cfg, config) -> None:
    """Raise ValueError naming every dimension tensor_parallel_size does not divide."""
    size = config.tensor_parallel_size
    dims = [("target", model_cfg)]
    if config.speculative_config is not None:
        from dspark.models.drafter_config import DrafterConfig

        dims.append(("drafter", DrafterConfig.from_pretrained(config.speculative_config.model)))
    bad = [
        f"the {who}'s {name} ({getattr(cfg, name)})"
        for who, cfg in dims
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
        if getattr(cfg, name) % size
    ]
    if bad:
        raise ValueError(f"tensor_parallel_size={size} must divide {', '.join(bad)}")


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    if device.type != "cuda":
        return torch.device("cpu")
    base = device.index or 0
    if torch.cuda.device_count() < base + size:
        raise ValueError(
            f"tensor_parallel_size={size} needs GPUs {base}..{base + size - 1}, but only "
            f"{torch.cuda.device_count()} are visible"
        )
    return torch.device("cuda", base + rank)


class TPWorld:
    """This process's view of the tensor-parallel world (every rank has one)."""

    def __init__(self, rank: int, size: int, device: torch.device, store, check: bool,
                 procs=(), errors=None):  # fmt: skip
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=_timeout())  # fmt: skip
        self.cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        self.tp = TPGroup(rank, size, dist.group.WORLD)
        self.rank, self.size, self.device, self.check = rank, size, device, check
        self.procs, self.errors = list(procs), errors
        self.lock = threading.Lock()
        self.healthy = True
        self.closed = False

    # -- host messages (rank 0 -> workers, gloo) --------------------------------------------
    def _broadcast_host(self, array: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        dist.broadcast(t, src=0, group=self.cpu_group)
        return t.numpy()

    def _send_header(self, op: int, args=(0, 0, 0, 0), meta=None) -> None:
        header = np.zeros(HEADER_LEN, dtype=np.int64)
        header[:5] = (op, *args)
        if meta is not None:
            header[5:] = meta
        self._broadcast_host(header)

    def send_step(self, host: HostStep, budget: int | None) -> None:
        payload = host.payload()
        args = (budget is not None, budget or 0, payload.size, 0)
        self._send_header(OP_STEP, args, host.meta)
        self._broadcast_host(payload)

    def send_profile(self, max_tokens, context_len, repeats, warmup) -> None:
        self._send_header(OP_PROFILE, (max_tokens or 0, context_len, repeats, warmup))

    def receive(self):
        """Workers: (op, args, HostStep | None)."""
        header = self._broadcast_host(np.zeros(HEADER_LEN, dtype=np.int64))
        op, args = int(header[0]), [int(a) for a in header[1:5]]
        host = None
        if op == OP_STEP:
            payload = self._broadcast_host(np.zeros(args[2], dtype=np.int64))
            host = HostStep.from_payload(header[5:].copy(), payload)
        return op, args, host

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    # -- device broadcasts from rank 0 (every rank, same order) ------------------------------
    def agree_tokens(self, out: torch.Tensor, num_out: torch.Tensor):
        """Rank 0's verify result [R, W] and counts [R] on every rank."""
        packed = torch.cat([out.long(), num_out.long().unsqueeze(1)], dim=1)
        if self.check:
            self.check_same("verify output", packed)
        dist.broadcast(packed, src=0, group=self.tp.group)
        return packed[:, :-1], packed[:, -1].to(num_out.dtype)

    def agree_drafts(self, spec, slots: torch.Tensor) -> None:
        """Rank 0's new drafts and confidences of the step's rows on every rank."""
        k = spec.k
        conf_bits = spec.conf[slots].view(torch.int32).long()
        packed = torch.cat([spec.draft_tokens[slots], conf_bits], dim=1)  # [R, 2K]
        if self.check:
            self.check_same("drafts and confidences", packed)
        dist.broadcast(packed, src=0, group=self.tp.group)
        if self.rank != 0:
            spec.draft_tokens[slots] = packed[:, :k]
            spec.conf[slots] = packed[:, k:].to(torch.int32).view(torch.float32)

    def check_same(self, what: str, x: torch.Tensor) -> None:
        """Debug (DSPARK_TP_CHECK=1): every rank's x equals rank 0's (host sync)."""
        x = x.reshape(-1).long().contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.tp.group)
        if self.rank == 0 and not all(torch.equal(p, x) for p in parts[1:]):
            raise RuntimeError(f"tensor-parallel ranks diverged: {what} differ from rank 0's")

    # -- lifetime ------------------------------------------------------------------------------
    @contextmanager
    def step_guard(self):
        """Rank 0: one step at a time; a step that raises leaves the workers unusable. A
        worker found dead fails the step before its first collective: gloo does not always
        see a killed peer, and a broadcast to it then waits for the group's timeout (10
        minutes by default; seen once in the CPU suite, forty-eighth session)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("the tensor-parallel workers have been shut down")
            dead = [p for p in self.procs if not p.is_alive()]  # (a waitpid each: ~µs)
            if dead:
                self.healthy = False
                detail = self.worker_errors()
                raise RuntimeError(f"tensor-parallel worker {dead[0].name} exited with code "
                                   f"{dead[0].exitcode}" + (f"\n{detail}" if detail else ""))
            try:
                yield
            except BaseException:
                self.healthy = False
                raise

    def worker_errors(self) -> str:
        lines = []
        while self.errors is not None and not self.errors.empty():
            rank, tb = self.errors.get()
            lines.append(f"tensor-parallel rank {rank} failed:\n{tb}")
        return "\n".join(lines)

    def shutdown(self, join_timeout_s: float = 30.0) -> None:
        """Rank 0: stop the workers (gracefully if they are between steps) and leave the
        process group. Idempotent; safe at interpreter exit."""
        acquired = self.lock.acquire(timeout=5.0)
        try:
            if self.closed:
                return
            self.closed = True
            graceful = acquired and self.healthy
            if graceful:
                try:
                    self._send_header(OP_SHUTDOWN)
                except Exception:  # noqa: BLE001 - a dead peer: fall back to terminate
                    graceful = False
            for p in self.procs:
                p.join(join_timeout_s if graceful else 1.0)
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
                    p.join(5.0)
                if p.is_alive():
                    p.kill()
                    p.join(5.0)
            destroy_process_group()
        finally:
            if acquired:
                self.lock.release()


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def launch(config, model_cfg, device: torch.device, dtype: torch.dtype) -> TPWorld:
    """Rank 0: start ranks 1..N-1 and join the process group with them."""
    size = config.tensor_parallel_size
    check_tensor_parallel_shapes(model_cfg, config)
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; "
                           "one tensor-parallel engine per process")  # fmt: skip
    os.environ.update(MULTICAST_OFF_ENV)  # inherited by the workers too
    dev0 = rank_device(device, 0, size)
    if dev0.type == "cuda":
        torch.cuda.set_device(dev0)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=_timeout(),
                          wait_for_workers=False)  # fmt: skip
    check = os.environ.get("DSPARK_TP_CHECK") == "1"
    ctx = torch.multiprocessing.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = []
    try:
        for rank in range(1, size):
            args = (rank, size, store.port, config, model_cfg, dtype, device, os.getpid(),
                    check, errors)  # fmt: skip
            p = ctx.Process(target=_worker_main, args=args, name=f"dspark-tp{rank}", daemon=True)
            p.start()
            procs.append(p)
        _wait_for_workers(store, procs, errors)
        return TPWorld(0, size, dev0, store, check, procs, errors)
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5.0)
        raise


def _wait_for_workers(store, procs, errors) -> None:
    deadline = time.monotonic() + _timeout().total_seconds()
    keys = [_READY_KEY.format(p_rank) for p_rank in range(1, len(procs) + 1)]
    while not store.check(keys):
        dead = [p for p in procs if not p.is_alive()]
        if dead or time.monotonic() > deadline:
            detail = []
            while not errors.empty():
                rank, tb = errors.get()
                detail.append(f"rank {rank}:\n{tb}")
            what = f"exited with code {dead[0].exitcode}" if dead else "did not connect in time"
            raise RuntimeError(f"tensor-parallel worker {what}" +
                               (":\n" + "\n".join(detail) if detail else ""))  # fmt: skip
        time.sleep(0.05)


def _watch_parent(parent_pid: int) -> None:
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)  # rank 0 is gone: nobody will ever send the next step

    threading.Thread(target=watch, name="dspark-tp-parent-watch", daemon=True).start()


def _worker_main(rank, size, port, config, model_cfg, dtype, device, parent_pid, check, errors):
    from dspark.engine.engine_process import ignore_group_signals

    ignore_group_signals()  # (rank 0 ends a worker, OP_SHUTDOWN, or its death: _watch_parent)
    os.environ.update(MULTICAST_OFF_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _watch_parent(parent_pid)
    try:
        dev = rank_device(device, rank, size)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=_timeout())
        store.set(_READY_KEY.format(rank), "1")
        world = TPWorld(rank, size, dev, store, check)
        from dspark.engine.model_runner import ModelRunner

        runner = ModelRunner(config, model_cfg, dev, dtype, world=world)
        worker_loop(runner)
        code = 0
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        code = 1
    if code == 0:  # after a failure a peer may be gone: do not wait on it
        destroy_process_group()
    # Skip the interpreter's teardown: C++ static destructors of the communication libraries
    # can abort ("terminate called without an active exception") after a clean shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_loop(runner) -> None:
    """Ranks 1..N-1: run what rank 0 broadcasts until it says stop."""
    world = runner.world
    while True:
        op, args, host = world.receive()
        if op == OP_SHUTDOWN:
            return
        if op == OP_STEP:
            runner.run_step(host, args[1] if args[0] else None)()
        elif op == OP_PROFILE:
            max_tokens, context_len, repeats, warmup = args
            runner.profile_cost(max_tokens or None, context_len, repeats, warmup)
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op}")
