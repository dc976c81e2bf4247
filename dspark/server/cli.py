"""`dspark serve`: the OpenAI-compatible server.

    dspark serve --model path/to/target \
        --speculative-config '{"method": "dspark", "model": "path/to/drafter"}' --port 8000

Binds 127.0.0.1 unless --host says otherwise. With --api-key (or DSPARK_API_KEY) every /v1
route needs `Authorization: Bearer KEY`. SIGTERM (or Ctrl-C) stops accepting requests, lets
in-flight ones finish for up to --shutdown-timeout seconds, aborts the rest, and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading

logger = logging.getLogger("dspark.serve")

DEFAULT_MODEL_NAME = "dspark-default"


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", default=None, help="target checkpoint folder (default: the bundled model)")
    a("--speculative-config", default=None, metavar="JSON",
      help='speculative decoding, same keys as the offline API, e.g. '
           '\'{"method": "dspark", "model": "path/to/drafter", "num_speculative_tokens": 7}\'')
    a("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, local only)")
    a("--port", type=int, default=8000)
    a("--api-key", default=None, help="require this bearer token (default: $DSPARK_API_KEY)")
    a("--served-model-name", default=None, help="model id in the API (default: --model)")
    a("--max-num-seqs", type=_positive_int, default=256)
    a("--max-model-len", type=_positive_int, default=None)
    a("--max-num-batched-tokens", type=_positive_int, default=None,
      help="tokens per step (default: 2048, plus max-num-seqs x K with speculation)")
    a("--block-size", type=_positive_int, default=16)
    a("--num-kv-blocks", type=_positive_int, default=None, help="override the KV cache size")
    a("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    a("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    a("--seed", type=int, default=0)
    a("--enforce-eager", action="store_true", help="no CUDA graphs")
    a("--no-async-scheduling", dest="async_scheduling", action="store_false",
      help="schedule each step after the previous one finished (no speculation only)")
    a("--no-engine-process", dest="engine_process", action="store_false",
      help="run the engine in a thread of the server's process (default: a process of its "
           "own, so HTTP streaming and the engine's host work do not share one GIL)")
    a("--api-server-count", type=_positive_int, default=1,
      help="API-server processes in front of the one engine process (sharing the port): one "
           "tops out at about a core of HTTP and detokenizing")
    a("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
      help="shard the model over N GPUs (N processes started by the server)")
    a("--load-format", default="auto", choices=["auto", "dummy"],
      help="dummy: random weights from config.json alone (benchmarks only)")
    a("--max-waiting", type=_positive_int, default=1024,
      help="waiting requests beyond which new ones get 503 + Retry-After")
    a("--max-body-bytes", type=_positive_int, default=1 << 20, help="request body limit (413)")
    a("--shutdown-timeout", type=float, default=30.0,
      help="seconds in-flight requests may take to finish after SIGTERM before being aborted")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"])  # fmt: skip


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)
    return p


class ServeError(Exception):
    """A configuration problem reported as one line and exit code 2."""


def _default_model() -> tuple[str, str | None, bool]:
    try:
        from dspark.demo import default_model_paths
    except ImportError:
        raise ServeError("--model is required (no bundled default model is available)") from None
    return default_model_paths()


def _speculative_config(text: str | None, default_drafter: str | None) -> dict | None:
    if text is None:
        if not default_drafter:
            return None
        spec = {"method": "dspark", "model": default_drafter, "num_speculative_tokens": 7}
        sts = os.path.join(default_drafter, "sts.json")  # calibration shipped with the demo
        if os.path.isfile(sts):
            spec["confidence_calibration_path"] = sts
        return spec
    from dspark.config import parse_speculative_json

    try:
        spec = parse_speculative_json(text)
    except ValueError as e:
        raise ServeError(str(e)) from None
    if "model" not in spec and default_drafter:
        spec["model"] = default_drafter
    return spec


def build_engine_config(args: argparse.Namespace):
    """(EngineConfig, served model name, is_gibberish). Raises ServeError."""
    from dspark.config import EngineConfig

    model, drafter, gibberish = args.model, None, False
    if model is None:
        model, drafter, gibberish = _default_model()
    if not os.path.isdir(model):
        raise ServeError(f"--model {model!r} is not a checkpoint folder")
    spec = _speculative_config(args.speculative_config, drafter)
    try:
        config = EngineConfig(
            model=model, device=args.device, dtype=args.dtype, seed=args.seed,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks, enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
            load_format=args.load_format, speculative_config=spec,
            tensor_parallel_size=args.tensor_parallel_size,
        )  # fmt: skip
    except (ValueError, TypeError) as e:
        raise ServeError(f"invalid configuration: {e}") from None
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else args.model)
    return config, name, gibberish


def _warn_if_open(host: str, api_key: str | None) -> None:
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it",
                       host)  # fmt: skip


def uvicorn_config(app, args: argparse.Namespace):
    """The HTTP server's settings for `app` (one API server, or each of several)."""
    import uvicorn

    return uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=int(args.shutdown_timeout) + 5, access_log=False,
    )  # fmt: skip


def run_serve(args: argparse.Namespace) -> int:
    from dspark.engine.engine_process import LOG_FORMAT

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    api_key = args.api_key or os.environ.get("DSPARK_API_KEY") or None
    try:
        config, name, gibberish = build_engine_config(args)
    except ServeError as e:
        print(f"dspark serve: error: {e}", file=sys.stderr)
        return 2
    if gibberish:
        logger.warning(
            "serving the bundled default model %s: it is a tiny RANDOM model, so its text is "
            "gibberish. Pass --model to serve a real checkpoint.", config.model,
        )  # fmt: skip
    if args.api_server_count > 1:
        if not args.engine_process:
            print("dspark serve: error: --api-server-count above 1 needs the engine process "
                  "(drop --no-engine-process)", file=sys.stderr)  # fmt: skip
            return 2
        _warn_if_open(args.host, api_key)
        from dspark.server.multi_server import run_multi_server

        return run_multi_server(args, config, name, api_key)
    from dspark.engine.async_engine import AsyncLLMEngine
    from dspark.server.api import build_app

    try:
        engine = AsyncLLMEngine.from_config(config, engine_process=args.engine_process)
    except Exception as e:  # noqa: BLE001 - report any loading failure plainly
        print(f"dspark serve: error: cannot load the engine: {e}", file=sys.stderr)
        return 1
    _warn_if_open(args.host, api_key)
    app = build_app(engine, name, api_key, args.max_body_bytes, args.max_waiting)
    server = GracefulServer(uvicorn_config(app, args), engine, args.shutdown_timeout)
    logger.info("serving %r (max_model_len=%d) on http://%s:%d", name, engine.max_model_len,
                args.host, args.port)  # fmt: skip
    server.run()
    engine.close()  # the engine process, or tensor-parallel workers
    return 0 if engine.dead_error is None else 1


def _graceful_server_class():
    import uvicorn

    class _GracefulServer(uvicorn.Server):
        """On SIGTERM/SIGINT: stop accepting, let the engine drain (aborting what is left
        after the timeout, so streams end cleanly), then let uvicorn close."""

        def __init__(self, config, engine, drain_timeout_s: float):
            super().__init__(config)
            self.engine, self.drain_timeout_s = engine, drain_timeout_s
            self._drain_asked = False
            self._loop = None  # (serve's event loop, once it runs)

        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            # A signal handler runs in the main thread between any two bytecodes, possibly
            # while that thread holds the engine's send lock (a request's submit; or this
            # handler's own drain, interrupted by a second SIGTERM: `kill` of the process
            # group, then the parent passing it on). Taking that lock here hung the server
            # for good. So the handler takes no lock: the drain is sent from the event loop
            # (or a thread of its own, before the loop runs), once.
            if not self._drain_asked:
                self._drain_asked = True
                self._defer(self._begin_drain)
            super().handle_exit(sig, frame)
            # a graceful shutdown exits 0 instead of re-raising the signal
            getattr(self, "_captured_signals", []).clear()

        def _defer(self, fn) -> None:
            loop = self._loop
            if loop is not None and loop.is_running():
                try:
                    loop.call_soon_threadsafe(fn)  # (no lock: a deque and the self-pipe)
                    return
                except RuntimeError:  # (closed meanwhile)
                    pass
            threading.Thread(target=fn, name="dspark-drain", daemon=True).start()

        def _begin_drain(self) -> None:
            logger.info("shutting down: finishing in-flight requests (up to %g s)",
                        self.drain_timeout_s)  # fmt: skip
            self.engine.begin_drain(self.drain_timeout_s)

    return _GracefulServer


def GracefulServer(config, engine, drain_timeout_s: float):  # noqa: N802 - a class factory
    return _graceful_server_class()(config, engine, drain_timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
