"""The HTTP front end: an OpenAI-compatible Starlette app over the engine core's pipes.

  app = build_app(core, tokenizer, served_name, api_key=None)     served by uvicorn (``cli``)
  POST /v1/completions, /v1/chat/completions   streamed as server-sent events ("data: {json}"
       per token, then "data: [DONE]") when "stream" is true, else one JSON body
  GET  /v1/models    the one model served;  GET /health    200 while the engine core lives,
       503 once it has gone;  GET /metrics    Prometheus text (``instruments.server.metrics``)

Each request gets an id, is checked and tokenized here (``instruments.server.api``), and is
sent to the core; the core's answer (accepted, or rejected with its reason: a 400) comes before
any token, so a request the engine can never run is refused before a stream starts. Tokens
come back from the core's reader thread onto this event loop, into the request's own queue;
each token is detokenized here and written as it comes (one chunk per token). A client that
leaves, mid-stream or while a non-streamed request runs, is seen at once (the ASGI disconnect
message, or a failed write) and its request is cancelled in the core, which frees its blocks
before its next step. Requests beyond the engine's running limit wait in the scheduler's queue
(vllm:num_requests_waiting), never refused.

With an API key, every /v1 route needs ``Authorization: Bearer KEY`` (else 401); /health and
/metrics stay open, as vLLM's do. Errors are OpenAI's body, {"error": {message, type, param,
code}}, with the status that fits: 400 bad JSON or parameters, 401 key, 404 model or route,
405 method, 413 body too large, 415 content type, 503 engine core gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from instruments.server import api
from instruments.server.api import ApiError
from instruments.server.metrics import CONTENT_TYPE, ServerMetrics


@dataclass
class Pending:
    """One request in flight: its queue of events from the core, and its token times."""

    job: api.Job
    arrival: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    times: list[float] = field(default_factory=list)
    ended: bool = False
    cached: int = 0  # prompt tokens the prefix tree gave it (known at its end)


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(api.error_body(err), status_code=err.status)


class SSEResponse(Response):
    """Server-sent events from ``chunks``; ``on_close()`` runs however the stream ends (done,
    client gone, write failed), and a client's disconnect is heard even between chunks."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        # no body and so no Content-Length: the stream's length is not known (chunked)
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                with contextlib.suppress(OSError):  # a write to a closed connection
                    async for piece in self.chunks:
                        await send({"type": "http.response.body", "body": piece,
                                    "more_body": True})
                    await send({"type": "http.response.body", "body": b"",
                                "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            self.on_close()


class Front:
    """The app's state: the core, the tokenizer, the requests in flight, the metrics."""

    def __init__(self, core: Any, tok: Any, served: str, api_key: str | None) -> None:
        self.core, self.tok, self.served, self.api_key = core, tok, served, api_key
        self.context, self.vocab = int(core.facts["context"]), int(core.facts["vocab"])
        self.eos_id = getattr(tok, "eos_id", None)
        self.metrics = ServerMetrics(served)
        self.pending: dict[int, Pending] = {}
        self.ids = itertools.count(1)
        self.created = api.now_s()
        self.gone = False

    # ----------------------------------------------------------- events from the core
    def dispatch(self, msg: tuple) -> None:
        """On the event loop: one message of the core's (``instruments.server.core``)."""
        kind = msg[0]
        if kind == "step":
            _, t, emitted, finished, state = msg
            ends = {rid: (reason, cached) for rid, reason, cached in finished}
            for rid, token in emitted:
                p = self.pending.get(rid)
                if p is None or p.ended:
                    continue  # cancelled here already; the core has not heard yet
                p.times.append(t)
                self.metrics.token(p.times, p.arrival)
                end = ends.get(rid)
                if end is not None:
                    p.ended, p.cached = True, end[1]
                    self.pending.pop(rid, None)
                    self.metrics.finished(end[0], len(p.job.prompt), end[1], p.times,
                                          p.arrival)
                p.queue.put_nowait(("token", token, end))
            self.metrics.state(state)
        elif kind == "state":
            self.metrics.state(msg[1])
        elif kind in ("accepted", "rejected"):
            p = self.pending.get(msg[1])
            if p is not None:
                p.queue.put_nowait(msg)
        elif kind == "gone":
            self.gone = True
            for p in self.pending.values():
                p.queue.put_nowait(("gone",))
            self.pending.clear()

    # -------------------------------------------------------------------- requests
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.api_key.encode()):
            raise ApiError(401, "a valid API key is needed: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", type_="authentication_error")

    async def body(self, request: Request) -> Any:
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise ApiError(415, f"the body must be JSON (Content-Type: application/json), got "
                           f"{ctype or 'no content type'!r}", code="unsupported_media_type")
        if int(request.headers.get("content-length") or 0) > api.MAX_BODY_BYTES:
            raise ApiError(413, f"the body is over {api.MAX_BODY_BYTES:,} bytes")
        raw = await request.body()
        if len(raw) > api.MAX_BODY_BYTES:
            raise ApiError(413, f"the body is over {api.MAX_BODY_BYTES:,} bytes")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") \
                from None

    async def start(self, job: api.Job) -> tuple[int, Pending]:
        """The job sent to the core and accepted there (ApiError 400 when it never can run)."""
        if self.gone:
            raise ApiError(503, "the engine core has gone; restart the server",
                           type_="server_error")
        rid = next(self.ids)
        p = Pending(job, time.monotonic())
        self.pending[rid] = p
        sampling = None if job.temperature == 0 else (job.temperature, job.top_p, job.top_k,
                                                      job.seed)
        self.core.submit(rid, job.prompt, job.max_tokens, None if job.ignore_eos
                         else self.eos_id, sampling)
        ev = await p.queue.get()
        if ev[0] == "rejected":
            self.pending.pop(rid, None)
            raise ApiError(400, ev[2], "max_tokens", "request_too_large")
        if ev[0] == "gone":
            raise ApiError(503, "the engine core has gone", type_="server_error")
        return rid, p

    def abort(self, rid: int, p: Pending, reason: str = "abort") -> None:
        """Cancel in the core (its blocks back before its next step); counted once."""
        if p.ended:
            return
        p.ended = True
        self.pending.pop(rid, None)
        self.metrics.finished(reason, len(p.job.prompt), 0, p.times, p.arrival)
        with contextlib.suppress(Exception):
            self.core.cancel(rid)

    async def tokens(self, rid: int, p: Pending) -> AsyncIterator[tuple[str, list[int],
                                                                        str | None]]:
        """(text, token ids, finish reason or None) per token; stop strings applied."""
        job = p.job
        detok, stops = api.Detokenizer(self.tok.decode), api.StopMatcher(job.stop)
        while True:
            ev = await p.queue.get()
            if ev[0] == "gone":
                raise ApiError(503, "the engine core has gone", type_="server_error")
            _, token, end = ev
            eos = token == self.eos_id and not job.ignore_eos
            text = "" if eos else detok.add(token)
            if end is not None:
                text += detok.flush()
            text, stopped = stops.feed(text)
            if stopped:
                self.abort(rid, p, "stop")
                yield text, [token], "stop"
                return
            if end is not None:
                yield text + stops.flush(), [token], end[0]
                return
            yield text, [token], None


def build_app(core: Any, tok: Any, served: str, api_key: str | None = None) -> Starlette:
    front = Front(core, tok, served, api_key)

    async def generate(request: Request, kind: str) -> Response:
        front.check_key(request)
        body = await front.body(request)
        job = api.parse_chat(body, served, tok, front.context) if kind == "chat" else \
            api.parse_completion(body, served, tok, front.context, front.vocab)
        rid, p = await front.start(job)
        name = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = api.now_s()
        return (stream(rid, p, name, created) if job.stream
                else await whole(request, rid, p, name, created))

    def stream(rid: int, p: Pending, name: str, created: int) -> Response:
        job = p.job

        async def chunks() -> AsyncIterator[bytes]:
            n, first = 0, True
            try:
                async for text, ids, finish in front.tokens(rid, p):
                    n += len(ids)
                    use = api.usage(job, n, p.cached) if job.continuous_usage else None
                    if text or job.token_ids or finish is not None or first:
                        yield _sse(api.chunk(job, name, created, text, ids, finish, first,
                                             use))
                        first = False
            except ApiError as err:
                yield _sse(api.error_body(err))
            else:
                if job.include_usage:
                    yield _sse(api.usage_chunk(job, name, created,
                                               api.usage(job, n, p.cached)))
            yield b"data: [DONE]\n\n"

        return SSEResponse(chunks(), lambda: front.abort(rid, p))

    async def whole(request: Request, rid: int, p: Pending, name: str, created: int
                    ) -> Response:
        async def collect() -> dict[str, Any]:
            text, ids, finish = [], [], "length"
            async for t, i, f in front.tokens(rid, p):
                text.append(t)
                ids.extend(i)
                finish = f or finish
            return api.final(p.job, name, created, "".join(text), ids, finish,
                             api.usage(p.job, len(ids), p.cached))

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(gone())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():  # the client left (or this handler was cancelled)
                task.cancel()
                front.abort(rid, p)
        if task.cancelled():
            return Response(status_code=499)
        return JSONResponse(task.result())

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def models(request: Request) -> Response:
        front.check_key(request)
        return JSONResponse({"object": "list", "data": [{
            "id": served, "object": "model", "created": front.created, "owned_by": "kvlab",
            "max_model_len": front.context}]})

    async def health(request: Request) -> Response:
        if front.gone or not core.alive:
            return JSONResponse({"status": "error", "error": "the engine core has gone"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(front.metrics.text(), media_type=CONTENT_TYPE)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        what = {404: f"no route {request.url.path!r}; allowed: /v1/completions, "
                "/v1/chat/completions, /v1/models, /health, /metrics",
                405: f"{request.method} is not allowed on {request.url.path}"}
        return _error(ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail))))

    async def on_crash(request: Request, exc: Exception) -> Response:
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                               type_="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        core.listen(lambda msg: loop.call_soon_threadsafe(front.dispatch, msg))
        yield

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={ApiError: on_api_error, HTTPException: on_http_error,
                           Exception: on_crash}, lifespan=lifespan)
    app.state.front = front
    return app


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
