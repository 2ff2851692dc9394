"""The chat web server: an OpenAI-compatible API and the chat page over a pool of model replicas.

`create_app(pool, settings)` returns a FastAPI app (scripts/chat_web.py is the recipe that loads
models and runs it with uvicorn):

    GET  /                      the chat page (nanochat/ui.html, self-contained, strict CSP)
    POST /v1/chat/completions   OpenAI chat completions: stream true (SSE) / false, n, stop, usage
    GET  /v1/models             the served model (and /v1/models/{id}: it, or 404 model_not_found)
    GET  /health                liveness, free generation slots, sampling defaults (never needs the API key)
    GET  /stats                 counters and per-replica state
    (every GET route answers HEAD too: monitors and gateways probe with it)

Concurrency: a `Worker` per generation slot; a request waits in a FIFO for a free one
(`WorkerPool`; both in nanochat/worker_pool.py, importable from here), then generation runs in a thread (`_Job`) so the event loop stays free. With
continuous batching (`replica_workers(engine, name, slots)`, slots > 1: chat_web's default) a
replica's `slots` workers share one BatchedEngine (nanochat/batching.py), which decodes all their
requests as rows of one step; with slots = 1 a replica serves one request at a time. A client that
disconnects stops its generation (a flag checked every token; a batched request waiting for rows or
its prefill leaves at once). /stats counts each request once: completed, errors or cancelled.

/health (for load balancers and monitors; never needs the API key) reports capacity in
generation rows: a batched replica has `slots` rows and a request of n samples holds n of them
(running, or holding a worker while it waits inside the replica for rows) until its answer ends;
an unbatched replica is one row, held by any request.
    workers    Workers in all (one per row of a batched replica, one per unbatched replica).
    slots      Rows in all: the most that can generate at once (equals workers as chat_web builds them).
    available  Rows free now, summed over replicas: each replica's rows less those its requests
               hold, capped by its idle workers. 0: a new request waits. A request of n starts at
               once when one replica has n free (a new request goes to the replica with the most
               free rows), so n > 1 can wait while available >= n is split over replicas.
    waiting    Requests in line for a worker (the line `ServerSettings.max_queue` bounds, 503 when
               full); one holding a worker while it waits for rows is in /stats' batching[].waiting.
Shutting down (`app.state.drain`, which scripts/chat_web.py calls on Ctrl-C / SIGTERM): new and
queued requests get a 503 `server_shutting_down` at once, running ones a short grace, then the
same error (a stream: as an error event and [DONE]), never a connection cut mid-answer.
A streamed answer's SSE events in OpenAI's chunk shape are nanochat/chat_sse.py's.

Limits (`ServerSettings`, nanochat/chat_api.py) are checked before any model work; every violation is a 4xx JSON error
in OpenAI's shape {"error": {"message", "type", "param", "code"}} and the server keeps serving; 429
and 503 carry `Retry-After`. A request's `model` may name anything: this local server has one model
and reports its own name. For a server on a user's machine (nanochat/http_guard.py says why): an
optional Host allow-list (DNS rebinding) that also refuses POSTs from pages of other origins,
JSON-only POST bodies (415 otherwise), and CORS only for origins listed in `ServerSettings.cors_origins`.
Below the app (http_guard.guarded_protocol, which serve_in_thread and serve_lifecycle.run_server
serve with): a request's headers must arrive within HEADER_TIMEOUT_S and take at most
MAX_HEADER_BYTES (a JSON 431 past it), and one address may hold
`ServerSettings.max_connections_per_client` connections (app.state carries it to them), an IPv6
client counted by its /64 there (http_guard.client_key) and by its address for the request limit.
WebSocket upgrades are off (`ws="none"`): no route takes one, and an upgraded connection left the
protocol without its connection_lost, so its count stayed for good.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations
# (`request: Request`) at runtime, and Request is imported inside create_app.
import asyncio
import dataclasses
import hmac
import secrets
import sys
import threading
import time
import weakref
from collections import defaultdict
from pathlib import Path

from nanochat.chat_api import (ApiError, ChatRequest, ServerSettings, default_per_client,  # noqa: F401
                               parse_chat_request, prompt_messages)
from nanochat.chat_sse import KEEPALIVE_S, _count_end, _sse, _sse_events
from nanochat.engine import TOOL_TEXT
from nanochat.sampling import MAX_SEED
from nanochat.serve_lifecycle import USAGE_SCOPE_KEY
from nanochat.http_guard import (HEADER_TIMEOUT_S, HostGuard, client_key, csp, default_connections_per_client,
                                 json_cors_middleware, read_json, require_json, uvicorn_options)
from nanochat.text_stream import TextStream
from nanochat.worker_pool import Worker, WorkerPool, _ClientSlots, replica_workers  # noqa: F401 (the server's API)

UI_PATH = Path(__file__).with_name("ui.html")
# How a too-long conversation's 400 begins: OpenAI's words, which client libraries match to tell a
# context overflow from other 400s (LiteLLM raises ContextWindowExceededError on them, which its
# users, e.g. aider, answer by trimming the history; CrewAI matches "maximum context length")
CONTEXT_EXCEEDED = "This model's maximum context length is"


# ------------------------------------------------------------------------------------ generation

class _Job:
    """One request's generation in a worker thread; events reach the event loop via a queue:
    ("delta", [(index, text)], [(index, finish_reason)] of the choices that ended in this step
    while others go on), ("done", finish_reasons of all choices, usage), ("error", message), and
    ("abort", ApiError), put by the server as it stops a running job (shutting down). The choices
    that end last finish only with "done", sent after the engine's generator closed cleanly: a
    failure there is an "error", never a stream that already said "stop". A stopped job sends
    nothing more; the request side counts the outcome (_count_end, _release_unused)."""

    def __init__(self, pool: WorkerPool, worker: Worker, req: ChatRequest, prompt: list[int],
                 max_tokens: int, stats: dict):
        self.pool, self.worker, self.req, self.prompt, self.max_tokens = pool, worker, req, prompt, max_tokens
        self.stats = stats
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.ended = False         # the request side read the final event ("done" / "error")
        self.usage = None          # the "done" event's token counts, once the request side read it
        self._stop_engine = None   # the engine stream's cancel(), where it has one (BatchedEngine)

    def stop(self) -> None:
        """The client is gone (event loop): stop; a batched request waiting for rows leaves at once."""
        self.cancel.set()
        if self._stop_engine is not None:   # read after the set: _generate checks the flag after assigning it
            self._stop_engine()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"gen-{self.worker.name}", daemon=True)
        self.thread.start()

    def _emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._generate()
        except Exception as e:  # reported to the client as a server_error; the server keeps serving
            self._emit("error", f"generation failed: {type(e).__name__}: {e}")
        finally:
            self.worker.busy_seconds += time.perf_counter() - t0
            try:
                self.loop.call_soon_threadsafe(self.pool.release, self.worker)
            except RuntimeError:
                pass

    def _generate(self) -> None:
        tok, req, n = self.worker.tokenizer, self.req, self.req.n
        engine = self.worker.engine
        stops = set(engine.default_stop_tokens) | {tok.encode_special("<|user_start|>")}
        special = {tok.encode_special(k): v for k, v in TOOL_TEXT.items()}
        seed = req.seed if req.seed is not None else secrets.randbelow(MAX_SEED + 1)   # 2**31 repeated within ~50k
        streams = [TextStream(tok, req.stop, special) for _ in range(n)]
        finish: list[str | None] = [None] * n
        counts = [0] * n
        gen = engine.generate(self.prompt, num_samples=n, max_tokens=self.max_tokens, temperature=req.temperature,
                              top_k=req.top_k, top_p=req.top_p, seed=seed, stop_tokens=stops)
        self._stop_engine = getattr(gen, "cancel", None)
        try:
            if self.cancel.is_set():   # stopped before the engine's stream existed (stop() saw no _stop_engine)
                return
            for column, _ in gen:
                if self.cancel.is_set():
                    return
                deltas, ended, step_tokens = [], [], 0
                for i, token in enumerate(column):
                    if finish[i]:   # an ended choice's row repeats its stop token: not generated
                        continue
                    counts[i] += 1
                    step_tokens += 1
                    text = streams[i].finish() if token in stops else streams[i].feed(token)
                    if token in stops or streams[i].stopped:
                        finish[i] = "stop"
                        ended.append((i, "stop"))
                    if text:
                        deltas.append((i, text))
                self.worker.tokens += step_tokens
                if all(finish):
                    ended = []  # the last to end finish with "done", once the generator has closed
                if deltas or ended:  # a stream sends a choice's finish as soon as it has one (n > 1)
                    self._emit("delta", deltas, ended)
                if all(finish):
                    break
        finally:
            gen.close()
        if self.cancel.is_set():   # a cancelled batched stream ends like a finished one: no answer to send
            return
        tails = [(i, streams[i].finish()) for i in range(n) if not finish[i]]
        if any(text for _, text in tails):
            self._emit("delta", [(i, t) for i, t in tails if t], [])
        finish = [f or "length" for f in finish]
        usage = {"prompt_tokens": len(self.prompt), "completion_tokens": sum(counts),
                 "total_tokens": len(self.prompt) + sum(counts)}
        self._emit("done", finish, usage)


# ------------------------------------------------------------------------------------ HTTP helpers

async def _wait_disconnect(request) -> None:
    """Returns when the client goes away (only call after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _start_job(pool: WorkerPool, worker: Worker, req: ChatRequest, prompt: list[int], max_tokens: int,
               stats: dict) -> _Job:
    """A request's job, started on `worker`. If building or starting it fails (no thread ran, so
    nothing will release the worker) it raises ApiError(500); the caller still holds the worker
    and `_release_unused` returns it and counts the error."""
    try:
        job = _Job(pool, worker, req, prompt, max_tokens, stats)
        job.start()
    except Exception as e:
        raise ApiError(500, f"generation failed to start: {type(e).__name__}: {e}") from e
    worker.requests += 1
    return job


def _release_unused(pool: WorkerPool, acq: asyncio.Future, job, stats: dict, failed: bool = False) -> None:
    """Cleanup as a request's response ends (from a `finally`): stop its job, or return / stop waiting
    for a worker. A job whose final event was not read was cancelled (also right at completion), a
    request without one while queued, unless an error ends it (`failed`, or the exception propagating)."""
    if job is not None:
        job.stop()
        if not job.ended:
            stats["cancelled"] += 1
        return
    ending = sys.exc_info()[1]   # the exception this `finally` propagates, if any
    failed = failed or (ending is not None and not isinstance(ending, (GeneratorExit, asyncio.CancelledError)))
    stats["errors" if failed else "cancelled"] += 1
    if acq.done():
        if not acq.cancelled() and acq.exception() is None:
            pool.release(acq.result())
    else:
        acq.cancel()


def _unstarted_cleanup(pool: WorkerPool, acq: asyncio.Future, stats: dict, release, started: list) -> None:
    """weakref.finalize of a stream's generator: the request's cleanup when it never ran. The
    collector may run it on any thread (a generation thread's allocation): asyncio futures (the
    worker claim, the next waiter's) are not thread-safe, so it runs on the event loop's thread."""
    if started:
        return

    def cleanup():
        _release_unused(pool, acq, None, stats)
        release()
    loop = acq.get_loop()
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop or loop.is_closed():   # closed: no loop left to race with
        cleanup()
    else:
        loop.call_soon_threadsafe(cleanup)


def weights_format(engine) -> str:
    """How a replica's matrices are stored: 'int8' for a model quantised by nanochat/quantize.py
    (chat_web --quantize int8), else 'none' (the compute dtype)."""
    inner = getattr(engine, "engine", engine)   # a BatchedEngine wraps the Engine
    return getattr(getattr(inner, "model", None), "quantization", "none")


class _UnexpectedAsJson:
    """ASGI middleware: an unexpected exception as the API's JSON 500, answered inside the CORS
    layer. Starlette runs an `Exception` handler in its outermost middleware, outside CORS, so a
    cross-origin page got that 500 without Access-Control-Allow-Origin: a bare network error in
    place of the error JSON. A response already started is left to end as it does."""

    def __init__(self, app, respond):
        self.app, self.respond = app, respond

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_seen(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, send_seen)
        except Exception as e:  # noqa: BLE001 - the catch-all that turns any failure into a 500 answer
            if started:
                raise
            await self.respond(e)(scope, receive, send)


# ------------------------------------------------------------------------------------ the app

def create_app(pool: WorkerPool, settings: ServerSettings | None = None):
    """The FastAPI app serving `pool` under `settings` (validated here)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException

    settings = (settings or ServerSettings()).validate()
    if settings.max_concurrent_per_client is None:  # one client may fill every slot, and queue a few
        settings = dataclasses.replace(settings, max_concurrent_per_client=default_per_client(len(pool.workers)))
    if settings.max_connections_per_client is None:   # enforced by the connection's protocol (serve_in_thread,
        settings = dataclasses.replace(settings, max_connections_per_client=   # run_server read it off app.state)
                                       default_connections_per_client(settings.max_concurrent_per_client))
    # a request's n samples are rows of one replica's batch (BatchedEngine): more than its slots
    # never run (a 500 after the request was queued); refused as any n over the limit, and /stats says so
    slots_n = [w.engine.slots for w in pool.workers if hasattr(w.engine, "slots")]
    if slots_n and min(slots_n) < settings.max_n:
        settings = dataclasses.replace(settings, max_n=min(slots_n))
    # redirect_slashes off: "POST /v1/chat/completions/" got a 307 to an absolute URL built from the
    # Host header (wrong behind a reverse proxy); now the JSON 404 that names the served endpoints
    app = FastAPI(title="nanochat", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    # added first = innermost of ours: its 500 passes through CORS (error_response is defined below)
    app.add_middleware(_UnexpectedAsJson, respond=lambda e: error_response(internal_error(e)))
    if settings.cors_origins:  # opt-in: lets pages of exactly these origins call the API
        # Any request header (the openai JS SDK adds x-stainless-*, others their own; a fixed list
        # fails their preflight), a public listed page calling a local server (Chrome's Private
        # Network Access preflight), and Retry-After readable by the page (429 / 503 back-off).
        # Safe: only the listed origins get any of it, and no credentials (cookies) are allowed.
        app.add_middleware(json_cors_middleware(), allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                           allow_private_network=True, expose_headers=["Retry-After"])
    if settings.allowed_hosts is not None:  # added last = outermost: checked before CORS and routing
        app.add_middleware(HostGuard, allowed=settings.allowed_hosts, origins=settings.cors_origins)
    stats: dict = defaultdict(int)
    live: set[_Job] = set()       # the running jobs: stopped when shutting down (drain)
    ran: weakref.WeakSet = weakref.WeakSet()   # every job whose thread may still run (finish)
    draining = False              # drain() was called: no new requests
    started = time.time()
    slots = _ClientSlots(settings.max_concurrent_per_client)
    html = UI_PATH.read_text(encoding="utf-8")
    page_headers = {"Content-Security-Policy": csp(html), "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}
    tokenizer, engine = pool.workers[0].tokenizer, pool.workers[0].engine
    model_card = {"id": settings.model_name, "object": "model", "created": int(started), "owned_by": "nanochat"}

    def error_response(e: ApiError) -> JSONResponse:
        stats[f"http_{e.status}"] += 1
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
        return JSONResponse(e.body(), status_code=e.status, headers={**headers, **e.headers})

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        # routing's 404 / 405 say what was asked and what is served (a client pointed at an endpoint
        # this server lacks, e.g. the legacy /v1/completions, learns which one to use), as OpenAI's
        # "Invalid URL (POST /v1/x)"
        asked, message = f"{request.method} {request.url.path[:200]}", str(e.detail)
        if e.status_code == 404:
            message = (f"Invalid URL ({asked}): this server serves POST /v1/chat/completions, GET /v1/models, "
                       "GET /health, GET /stats and the chat page at GET /")
        elif e.status_code == 405 and e.headers and "Allow" in e.headers:
            message = f"Method not allowed ({asked}); allowed: {e.headers['Allow']}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(ApiError(e.status_code, message, code=code, headers=e.headers))  # e.g. a 405's Allow

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e):
        # pydantic's error type in OpenAI's words: a field left out, one of the wrong type, a bad value
        kind = (e.errors()[:1] or [{}])[0].get("type", "")
        code = ("missing_required_parameter" if kind == "missing" else
                "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")
        return error_response(ApiError(400, f"invalid request: {e.errors()[:1]}", code=code))

    def internal_error(e: Exception) -> ApiError:
        return ApiError(500, f"internal error: {type(e).__name__}")

    @app.exception_handler(Exception)   # (a fallback: _UnexpectedAsJson answers first)
    async def _unexpected(request, e: Exception):
        return error_response(internal_error(e))

    def check_auth(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    # HEAD too: uptime monitors and `curl -I` probe with it (a 405 reads as "down")
    @app.api_route("/", methods=["GET", "HEAD"])
    async def index():
        return HTMLResponse(html, headers=page_headers)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "model": settings.model_name, "workers": len(pool.workers), "slots": pool.slots,
                "available": pool.available, "waiting": pool.waiting, "auth": settings.api_key is not None,
                "sampling": settings.sampling(),   # the chat page's settings start from these
                "context_len": engine.max_seq_len}   # the page tells a context cut-off from a max_tokens one

    @app.api_route("/stats", methods=["GET", "HEAD"])   # HEAD as the other GET routes: a monitor's probe
    async def get_stats(request: Request):
        check_auth(request)
        return {"model": settings.model_name, "uptime_s": round(time.time() - started, 1),
                "requests": dict(stats), "active_clients": len(slots.active), "waiting": pool.waiting,
                "workers": [{"name": w.name, "device": str(w.engine.device), "busy": w.busy, "rows": w.rows,
                             "requests": w.requests, "tokens": w.tokens, "busy_s": round(w.busy_seconds, 2),
                             "weights": weights_format(w.engine)}
                            for w in pool.workers],
                "batching": [{"slots": e.slots, "live_rows": e.live_rows, "waiting": e.waiting, "steps": e.steps,
                              "rows_stepped": e.rows_stepped, "mean_batch": round(e.rows_stepped / max(e.steps, 1), 2)}
                             for e in {id(w.engine): w.engine for w in pool.workers}.values() if hasattr(e, "slots")],
                "context_len": engine.max_seq_len, "limits": settings.public()}

    # HEAD too, as / and /health: monitors of an OpenAI-compatible server probe /v1/models (a 405 reads as "down")
    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])  # :path: a --model-name may contain "/"
    async def model(model_id: str, request: Request):
        check_auth(request)
        if model_id != settings.model_name:
            raise ApiError(404, f"model {model_id!r} not found; this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")
        return model_card

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        require_json(request)
        req = parse_chat_request(await read_json(request, settings.max_body_bytes), settings)
        try:
            prompt = tokenizer.render_for_completion({"messages": prompt_messages(req.messages)})
        except ValueError as e:
            raise ApiError(400, f"'messages': {e}", param="messages", code="invalid_value") from None
        room = engine.max_seq_len - len(prompt)
        if room < 1:   # worded as OpenAI's: clients that trim history on overflow match its opening words
            raise ApiError(400, f"{CONTEXT_EXCEEDED} {engine.max_seq_len} tokens; the conversation is {len(prompt)} "
                                "tokens, leaving no room for a reply: shorten it or start a new chat",
                           param="messages", code="context_length_exceeded")
        if draining:   # no await from here to the claim: nothing joins the line after drain() emptied it
            raise shutting_down("the server is shutting down; retry once it is back")
        release = slots.acquire(client_key(request.client.host, 128) if request.client else "unknown")
        if pool.waiting >= settings.max_queue:
            release()
            raise ApiError(503, f"server busy: {pool.waiting} requests are waiting; retry later", code="server_busy",
                           headers={"Retry-After": "1"})
        acq = pool.claim(req.n)   # in line now, with no await since the check: the next request's check counts it
        stats["chat_requests"] += 1
        max_tokens = min(req.max_tokens or settings.default_max_tokens, room)
        meta = {"id": "chatcmpl-" + secrets.token_hex(12), "created": int(time.time()),
                "model": settings.model_name}
        args = (req, prompt, max_tokens, meta, acq)
        if req.stream:
            started = []
            events = stream(*args, release, started, request.scope)
            # a client gone before the response starts leaves the generator unstarted: its `finally`
            # never runs, so its place in line (or the worker it was given) is given back when the
            # generator object goes; a started one gives it back itself
            weakref.finalize(events, _unstarted_cleanup, pool, acq, stats, release, started)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(release))
        try:
            result = await complete(request, *args)
        finally:
            release()
        return JSONResponse(result) if result is not None else Response(status_code=499)

    async def stream(req: ChatRequest, prompt, max_tokens, meta, acq, release, started: list, scope: dict):
        started.append(True)
        job, failed = None, False
        try:
            while not (await asyncio.wait({acq}, timeout=KEEPALIVE_S))[0]:
                yield ": waiting for a free model replica\n\n"  # SSE comment; also detects a gone client
            try:
                job = _start_job(pool, acq.result(), req, prompt, max_tokens, stats)
                live.add(job)
                ran.add(job)
            except ApiError as e:  # the 200 is sent: an error event, as OpenAI reports errors mid-stream
                failed = True
                yield _sse(e.body())
                yield "data: [DONE]\n\n"
                return
            async for event in _sse_events(job, meta):
                yield event
        finally:
            if job is not None and job.usage is not None:   # RequestLog's token count, include_usage or not
                scope[USAGE_SCOPE_KEY] = job.usage
            live.discard(job)
            _release_unused(pool, acq, job, stats, failed)
            release()

    async def complete(request: Request, req: ChatRequest, prompt, max_tokens, meta, acq):
        gone, job = asyncio.ensure_future(_wait_disconnect(request)), None
        try:
            await asyncio.wait({acq, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not acq.done():
                return None
            job = _start_job(pool, acq.result(), req, prompt, max_tokens, stats)
            live.add(job)
            ran.add(job)
            texts = [[] for _ in range(req.n)]
            while True:
                getter = asyncio.ensure_future(job.events.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    return None
                event = getter.result()
                if event[0] == "delta":
                    for i, t in event[1]:
                        texts[i].append(t)
                elif event[0] == "done":
                    _count_end(job, event)
                    choices = [{"index": i, "message": {"role": "assistant", "content": "".join(texts[i])},
                                "logprobs": None, "finish_reason": f} for i, f in enumerate(event[1])]
                    return {**meta, "object": "chat.completion", "choices": choices, "usage": event[2]}
                elif event[0] == "abort":
                    raise event[1]
                else:
                    _count_end(job, event)
                    raise ApiError(500, event[1])
        finally:
            gone.cancel()
            live.discard(job)
            _release_unused(pool, acq, job, stats)

    def shutting_down(message: str) -> ApiError:
        return ApiError(503, message, code="server_shutting_down", headers={"Retry-After": "1"})

    def stop_running() -> None:
        for job in list(live):   # as a gone client stops it; its request answers the "abort"
            job.stop()
            job.events.put_nowait(("abort", shutting_down(
                "the server is shutting down: this reply was stopped before it finished; retry once it is back")))
        live.clear()

    def drain(stop_after: float = 0.0) -> None:
        """Shut down in order (call on the event loop, as the server starts its graceful shutdown):
        new requests and those waiting for a replica are answered now, running generations get
        `stop_after` seconds to finish and are then stopped; each ends with a 503
        `server_shutting_down` (a stream: that error event and [DONE]). Left to uvicorn alone, they
        would be cancelled when its grace period ends: a connection cut mid-answer. A second call can
        only bring the stop forward."""
        nonlocal draining
        draining = True
        pool.fail_waiting(lambda: shutting_down("the server is shutting down; retry once it is back"))
        asyncio.get_running_loop().call_later(max(stop_after, 0.0), stop_running)

    def finish(timeout: float = 10.0) -> None:
        """After the server stopped (its drain stopped every generation): wait for the generation
        threads and the batching schedulers to end. Left running, a model step still in flight as
        the interpreter exits can abort the process ("terminate called without an active
        exception", exit -6) instead of the clean exit 0."""
        deadline = time.monotonic() + timeout
        for job in list(ran):
            job.thread.join(max(0.0, deadline - time.monotonic()))
        for engine in {id(w.engine): w.engine for w in pool.workers}.values():
            if hasattr(engine, "slots"):   # a BatchedEngine: its scheduler thread
                engine.close(max(0.0, deadline - time.monotonic()))

    app.state.drain, app.state.finish = drain, finish
    app.state.max_connections_per_client = settings.max_connections_per_client
    return app


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, header_timeout_s: float = HEADER_TIMEOUT_S):
    """Run `app` under uvicorn in a daemon thread (tests), with chat_web's connection guards
    (http_guard.uvicorn_options). Returns (server, base_url); stop it with
    `server.should_exit = True` and `server.thread.join()`."""
    import socket

    import uvicorn

    sock = socket.create_server((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2,
                                            **uvicorn_options(app, header_timeout_s)))
    server.thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    server.thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not server.thread.is_alive():
            raise RuntimeError("uvicorn did not start within 30 s")
        time.sleep(0.02)
    return server, f"http://{host}:{sock.getsockname()[1]}"
