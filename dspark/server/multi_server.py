"""`dspark serve --api-server-count N`: N API-server processes in front of one engine process.

One API-server process tops out at about one core of HTTP, detokenizing and streaming: on the
H200 host the trained 33.6 M pair's speculative arms were capped at ~53-55k output tok/s
served, against 87-117k through the offline API (thirty-eighth session). Here the engine
process is started once, with a command pipe and an event pipe per API server
(engine/server_links.py); each API server is a process of its own that binds the same
address with SO_REUSEPORT, so the kernel spreads connections over them, and attaches to its
pipes (ProcessCore(pipes=...)). Every server answers every endpoint; /metrics gives the
engine's counters (shared) and that server's own HTTP counters. Responses carry the headers
`x-dspark-api-server: <index>` and `x-dspark-api-server-pid: <its process id>`.

Shutdown: SIGTERM or SIGINT to this process is passed on to every API server as SIGTERM;
each stops accepting and lets its requests finish (--shutdown-timeout), and the engine drains
and stops once every server has asked (or left). An API server that dies has its requests
aborted; the others keep serving. If this process is killed outright, each server notices
within a second and shuts down as on SIGTERM.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time

logger = logging.getLogger(__name__)

SERVER_HEADER = b"x-dspark-api-server"
PID_HEADER = b"x-dspark-api-server-pid"


class _ServerHeader:
    """ASGI middleware: every HTTP response names the API server that made it."""

    def __init__(self, app, index: int):
        self.app = app
        self.headers = [(SERVER_HEADER, str(index).encode()),
                        (PID_HEADER, str(os.getpid()).encode())]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self.headers]
            await send(message)

        await self.app(scope, receive, send_named)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _exit_with_parent(parent_pid: int, period_s: float = 1.0) -> None:
    """A daemon thread: once the process that started this one is gone (killed without a
    chance to pass a signal on), stop as on SIGTERM, so that no orphaned server keeps the
    port (the engine process then sees every pipe close, and exits)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(period_s)
        logger.warning("the serving process %d is gone: shutting down", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dspark-parent-watch", daemon=True).start()


def api_server_main(args, config, name: str, api_key: str | None, index: int, cmd_w,
                    evt_r, parent_pid: int | None = None) -> None:  # fmt: skip
    """One API-server process: attach to the engine's pipes, serve HTTP on the shared port."""
    from dspark.engine.engine_process import LOG_FORMAT

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    from dspark.engine.async_engine import AsyncLLMEngine
    from dspark.engine.engine_process import ProcessCore
    from dspark.server.api import build_app
    from dspark.server.cli import GracefulServer, uvicorn_config

    try:
        core = ProcessCore(config, pipes=(cmd_w, evt_r))
    except RuntimeError as e:
        logger.error("API server %d: cannot load the engine: %s", index, e)
        raise SystemExit(1) from None
    core.join_timeout_s = args.shutdown_timeout + 10.0
    engine = AsyncLLMEngine(core=core)
    try:
        sock = _listening_socket(args.host, args.port)
    except OSError as e:
        logger.error("API server %d: cannot bind %s:%d: %s", index, args.host, args.port, e)
        core.close()
        raise SystemExit(1) from None
    app = _ServerHeader(build_app(engine, name, api_key, args.max_body_bytes, args.max_waiting),
                        index)  # fmt: skip
    GracefulServer(uvicorn_config(app, args), engine, args.shutdown_timeout).run(sockets=[sock])
    engine.close()
    if engine.dead_error is not None:
        logger.error("API server %d: %s", index, engine.dead_error)
    raise SystemExit(0 if engine.dead_error is None else 1)


def start_multi_server(args, config, name: str, api_key: str | None, setup=None) -> tuple:
    """Start the engine process (`setup`: as ProcessCore's) and args.api_server_count API
    servers. Returns (engine process, server processes); no pipe end stays here."""
    from dspark.engine.engine_process import core_process_main

    ctx = mp.get_context("spawn")  # (never fork a process that may hold CUDA state)
    n = args.api_server_count
    cmd = [ctx.Pipe(duplex=False) for _ in range(n)]  # (engine's end, server's end)
    evt = [ctx.Pipe(duplex=False) for _ in range(n)]  # (server's end, engine's end)
    level = logging.getLogger().getEffectiveLevel()
    # not a daemon: a tensor-parallel engine starts worker processes of its own
    engine = ctx.Process(target=core_process_main, name="dspark-engine-core",
                         args=(config, [r for r, _ in cmd], [w for _, w in evt], level, setup))
    engine.start()
    servers = [ctx.Process(target=api_server_main, name=f"dspark-api-server-{i}",
                           args=(args, config, name, api_key, i, cmd[i][1], evt[i][0],
                                 os.getpid()))
               for i in range(n)]  # fmt: skip
    for proc in servers:
        proc.start()
    # each pipe closes when its two holders are gone (EOF), so this process keeps no end
    for conn in (c for pair in cmd + evt for c in pair):
        conn.close()
    return engine, servers


def stop_servers(servers: list) -> None:
    """SIGTERM to every API server still running (each drains: GracefulServer)."""
    for proc in servers:
        if proc.is_alive() and proc.pid is not None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def wait_multi_server(engine, servers: list) -> int:
    """Wait for every API server, then for the engine (which stops once they are gone);
    0 when every server exited cleanly."""
    for proc in servers:
        proc.join()
        if proc.exitcode != 0:
            logger.warning("API server %s exited with code %s", proc.name, proc.exitcode)
    engine.join(30)
    if engine.is_alive():  # (it ignores SIGTERM: engine_process.core_process_main)
        logger.warning("the engine process did not exit: killing it")
        engine.kill()
        engine.join(10)
    return 0 if all(p.exitcode == 0 for p in servers) else 1


def run_multi_server(args, config, name: str, api_key: str | None) -> int:
    """`dspark serve --api-server-count N`: start, pass SIGTERM / SIGINT on, wait."""
    engine, servers = start_multi_server(args, config, name, api_key)

    def forward(sig, frame) -> None:
        logger.info("shutting down %d API servers", len(servers))
        stop_servers(servers)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    logger.info("serving %r with %d API-server processes on http://%s:%d", name, len(servers),
                args.host, args.port)  # fmt: skip
    return wait_multi_server(engine, servers)
