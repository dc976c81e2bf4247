"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (both with SSE
streaming), /v1/models, /health and /metrics, in front of an AsyncLLMEngine."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStoppedError
from dspark.outputs import RequestOutput
from dspark.server import protocol as P
from dspark.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_V1_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


class ClientDisconnected(Exception):
    pass


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(P.error_body(e.status, e.message, e.param, e.code), e.status, e.headers)


class _SSEResponse(StreamingResponse):
    """Streaming response that runs `on_close` however the stream ends (finished,
    client gone, task cancelled), so an abandoned request is always aborted."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            with contextlib.suppress(BaseException):
                await self.body_iterator.aclose()


class _Server:
    def __init__(self, engine: AsyncLLMEngine, model: str, api_key: str | None,
                 max_body_bytes: int, max_waiting: int):  # fmt: skip
        self.engine, self.model, self.api_key = engine, model, api_key
        self.max_body_bytes, self.max_waiting = max_body_bytes, max_waiting
        self.metrics = ServerMetrics(model)
        self.tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-tok")

    # -- request checks ---------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(401, "missing or invalid API key (use 'Authorization: Bearer KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def parse(self, request: Request, model_cls):
        limit = self.max_body_bytes
        too_big = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        try:
            req = model_cls.model_validate_json(b"".join(chunks))
        except ValidationError as e:
            msg, param = P.describe_validation_error(e)
            raise APIError(400, msg, param) from None
        if req.model is not None and req.model != self.model:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves "
                           f"{self.model!r}", "model", "model_not_found")  # fmt: skip
        try:
            params = req.to_sampling_params()
        except ValueError as e:
            raise APIError(400, str(e), _guess_param(str(e), req)) from None
        if not self.engine.accepting:
            raise self._unavailable()
        if self.engine.num_waiting() >= self.max_waiting:
            raise APIError(503, f"too many waiting requests (max {self.max_waiting}); retry",
                           code="queue_full", headers={"Retry-After": "1"})  # fmt: skip
        return req, params

    def _unavailable(self) -> APIError:
        if self.engine.dead_error is not None:
            return APIError(500, str(self.engine.dead_error),
                            code="engine_dead")  # fmt: skip
        return APIError(503, "the server is shutting down", code="shutting_down",
                        headers={"Retry-After": "5"})  # fmt: skip

    async def run_tok(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            self.tok_pool, lambda: fn(*args, **kwargs)
        )

    async def prepare_prompt(self, prompt: str | list[int]):
        tok = self.engine.tokenizer
        if isinstance(prompt, str) and tok is not None:
            ids = await self.run_tok(tok.encode, prompt, add_special_tokens=False)
            return {"prompt": prompt, "prompt_token_ids": list(ids)}
        return prompt

    async def chat_prompt(self, req: P.ChatCompletionRequest) -> str:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions",
                           "messages", "no_chat_template")  # fmt: skip
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            return await self.run_tok(tok.apply_chat_template, messages, tokenize=False,
                                      add_generation_prompt=req.add_generation_prompt is not False)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None

    # -- generation -------------------------------------------------------------------------
    async def generate(self, request: Request, req, params, prompt, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        arrival = time.time()
        prompt = await self.prepare_prompt(prompt)
        eng = self.engine

        async def start():
            stream = await eng.add_request(rid, prompt, params, req.cache_salt, arrival)
            out = await stream.get()
            while not (req.stream or out.finished):
                out = await stream.get()
            return stream, out

        try:
            stream, out = await _until_disconnect(request, start(), rid, eng)
            if req.stream:
                gen = self.stream_chunks(req, params, stream, out, chat, rid)
                return _SSEResponse(gen, lambda: None if stream.finished else eng.abort(rid))
        except ValueError as e:
            raise APIError(400, str(e), _guess_param(str(e), req)) from None
        except (EngineDeadError, EngineStoppedError):
            raise self._unavailable() from None
        except ClientDisconnected:
            return Response(status_code=499)
        self.metrics.observe_finished(out)
        comp, created = out.outputs[0], int(arrival)
        common = dict(id=rid, created=created, model=self.model, usage=P.usage_of(out),
                      spec_decode=out.spec_decode)  # fmt: skip
        if chat:
            choice = P.ChatChoice(message=P.ChatResponseMessage(content=comp.text),
                                  finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)
            return JSONResponse(P.ChatCompletionResponse(choices=[choice], **common).model_dump())
        choice = P.CompletionChoice(text=comp.text, finish_reason=comp.finish_reason,
                                    stop_reason=comp.stop_reason)  # fmt: skip
        return JSONResponse(P.CompletionResponse(choices=[choice], **common).model_dump())

    async def stream_chunks(self, req, params, stream, out: RequestOutput, chat: bool, rid):
        created, delta_of = int(time.time()), P.TextDelta(params.stop_strings)
        Chunk = P.ChatCompletionChunk if chat else P.CompletionChunk
        opts = req.stream_options or P.StreamOptions()
        fast_delta = delta_renderer(chat, rid, created, self.model)
        # without a tokenizer there is no text: completion chunks carry the new token ids
        tokenless = self.engine.tokenizer is None and not chat
        num_sent = 0

        def chunk(text: str | None, finish: RequestOutput | None, role=None, ids=None):
            plain = finish is None and role is None and ids is None
            if plain and not opts.continuous_usage_stats:
                return fast_delta(text)  # the hot path: same JSON, no pydantic
            comp = finish.outputs[0] if finish is not None else None
            reason = comp.finish_reason if comp else None
            if chat:
                choice = P.ChatChunkChoice(delta=P.DeltaMessage(role=role, content=text),
                                           finish_reason=reason)  # fmt: skip
            else:
                choice = P.CompletionChoice(text=text or "", finish_reason=reason,
                                            stop_reason=comp.stop_reason if comp else None)
            usage = P.usage_of(out) if opts.continuous_usage_stats else None
            spec = finish.spec_decode if finish is not None else None
            body = Chunk(id=rid, created=created, model=self.model, choices=[choice],
                         usage=usage, spec_decode=spec)  # fmt: skip
            if ids is None:
                return P.sse(body)
            body = body.model_dump(mode="json")
            body["choices"][0]["token_ids"] = ids
            return P.sse(body)

        try:
            if chat:
                yield chunk("", None, role="assistant")
            while True:
                text = delta_of(out)
                ids = None
                if tokenless:
                    ids = list(out.outputs[0].token_ids[num_sent:])
                    num_sent += len(ids)
                if text or ids or out.finished:
                    yield chunk(text, out if out.finished else None, ids=ids)
                if out.finished:
                    break
                out = await stream.get()
            self.metrics.observe_finished(out)
            if opts.include_usage:
                yield P.sse(Chunk(id=rid, created=created, model=self.model, choices=[],
                                  usage=P.usage_of(out), spec_decode=out.spec_decode))  # fmt: skip
        except (EngineDeadError, EngineStoppedError) as e:
            yield P.sse(P.error_body(500, str(e), code="engine_dead"))
        yield "data: [DONE]\n\n"


def delta_renderer(chat: bool, rid: str, created: int, model: str):
    """text -> the SSE line of a plain content chunk, the JSON that P.ChatCompletionChunk /
    P.CompletionChunk would give, built by string concatenation (it runs once per token)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = json.dumps({"id": rid, "object": kind, "created": created, "model": model})[:-1]
    if chat:
        mid, tail = '"delta":{"role":null,"content":', '},"logprobs":null,"finish_reason":null'
    else:
        mid, tail = '"text":', ',"logprobs":null,"finish_reason":null,"stop_reason":null'
    prefix = f'data: {head},"choices":[{{"index":0,{mid}'
    suffix = f'{tail}}}],"usage":null,"spec_decode":null}}\n\n'
    return lambda text: prefix + json.dumps(text, ensure_ascii=False) + suffix


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(request: Request, awaitable, rid: str, engine: AsyncLLMEngine):
    """Await `awaitable` unless the client goes away first (then abort rid)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        engine.abort(rid)
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    engine.abort(rid)
    raise ClientDisconnected


class _StatusCounter:
    """Pure ASGI middleware counting /v1 responses by status (streams are not buffered)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1"):
            return await self.app(scope, receive, send)

        async def send_counted(message):
            if message["type"] == "http.response.start":
                endpoint = path if path in _V1_ENDPOINTS else "other"
                self.metrics.observe_status(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, send_counted)


def _guess_param(message: str, req) -> str | None:
    head = message.split()[0].rstrip(":=,") if message.split() else ""
    head = head.split("=")[0]
    if head.startswith("prompt"):
        return "messages" if isinstance(req, P.ChatCompletionRequest) else "prompt"
    if head == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return head if head in type(req).model_fields else None


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 1 << 20, max_waiting: int = 1024) -> FastAPI:  # fmt: skip
    srv = _Server(engine, served_model_name, api_key, max_body_bytes, max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        # What the server's process holds now (libraries, tokenizer, app: ~240k objects) lives
        # as long as it. A full collection walks all of it: 130-230 ms with the event loop
        # stopped (development machine), and Python starts one whenever the objects surviving
        # since the last reach a quarter of the heap, which streaming's churn does over a long
        # run. Frozen objects are skipped; objects made from here on are not.
        gc.collect()
        gc.freeze()
        yield
        await engine.shutdown(0.0)
        srv.tok_pool.shutdown(wait=False)

    app = FastAPI(title="dspark", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.server = srv
    app.state.metrics = srv.metrics
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return JSONResponse(P.error_body(e.status_code, str(e.detail)), e.status_code, e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        logger.exception("unhandled error in %s", request.url.path)
        return JSONResponse(P.error_body(500, f"internal error: {type(e).__name__}"), 500)

    app.add_middleware(_StatusCounter, metrics=srv.metrics)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(srv.check_auth)])

    @v1.post("/completions")
    async def completions(request: Request):
        req, params = await srv.parse(request, P.CompletionRequest)
        try:
            prompt = req.single_prompt()
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        return await srv.generate(request, req, params, prompt, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req, params = await srv.parse(request, P.ChatCompletionRequest)
        prompt = await srv.chat_prompt(req)
        return await srv.generate(request, req, params, prompt, chat=True)

    @v1.get("/models")
    async def models():
        card = P.ModelCard(id=served_model_name, root=engine.model_path,
                           max_model_len=engine.max_model_len)  # fmt: skip
        return JSONResponse(P.ModelList(data=[card]).model_dump())

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if engine.dead_error is not None:
            return _error_response(srv._unavailable())
        if not engine.is_alive:
            return _error_response(APIError(500, "the engine is not running", code="engine_dead"))
        return JSONResponse({"status": "ok" if engine.accepting else "draining"})

    @app.get("/metrics")
    async def metrics():
        srv.metrics.update_from_snapshot(engine.snapshot(), engine.is_alive)
        body, content_type = srv.metrics.render()
        return Response(body, media_type=content_type)

    return app
