"""A chat server process's start and stop, shared by scripts/chat_web.py and the server that
scripts/load_test.py starts: the port check before the model loads, the addresses to open
(`browse_urls`), and uvicorn run so that Ctrl-C / SIGTERM / SIGHUP shut it down in order (new and
queued requests get a 503 `server_shutting_down` at once, answers in progress get
GRACE_S - STOP_EARLY_S seconds and then end with that error, never a cut connection; the process
returns 0 instead of dying of the re-raised signal), logging one line per request as it ends
(`RequestLog`).

SIGHUP (the terminal or ssh session the server runs in closed) stops it as SIGTERM does: it used to
kill the process at once, cutting every stream mid-answer. The terminal is gone by then, so the
output moves to <base dir>/hangup.log, as a training run's does (nanochat/loop.py). A server started
with SIGHUP ignored (nohup) keeps ignoring it."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import signal
import socket
import threading
import time

GRACE_S = 5         # uvicorn's graceful shutdown: how long answers in progress get after Ctrl-C / SIGTERM
STOP_EARLY_S = 1.0  # running generations are stopped this long before it ends, so each ends properly
USAGE_SCOPE_KEY = "nanochat.usage"   # the server leaves a stream's token counts here for RequestLog


def check_port_free(host: str, port: int, flag: str = "--host/--port") -> None:
    """RequestError naming `flag` when nothing can listen on host:port (another server has it):
    said before the model loads and warms up (minutes on a GPU), not after, as uvicorn would."""
    from nanochat.errors import RequestError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # uvicorn's "::" socket is dual-stack (no IPV6_V6ONLY): it also collides with IPv4 listeners
    dual = host == "::" and socket.has_dualstack_ipv6()
    try:   # resolved first: create_server reports a name that does not resolve like any bind failure
        socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror as e:   # not a taken port ("Name or service not known" read as one)
        raise RequestError(f"{flag}: cannot listen on {host}:{port}: {host!r} is not an address of this machine or "
                           f"a name that resolves ({e.strerror or e}); accepted: 127.0.0.1, ::1, 0.0.0.0, :: or "
                           "another address of this machine, or a host name that resolves to one") from None
    try:   # create_server sets SO_REUSEADDR as uvicorn does: a port in TIME_WAIT is not "in use"
        socket.create_server((host, port), family=family, dualstack_ipv6=dual).close()
    except OSError as e:
        why = str(e.strerror or e).split(" (while")[0]   # create_server appends the address again
        where = "choose another --port, or a --host address of this machine" if "host" in flag else "choose another --port"
        raise RequestError(f"{flag}: cannot listen on {host}:{port} ({why}); stop the server using that "
                           f"port, {where}") from None


WILDCARDS = ("0.0.0.0", "::")   # bind addresses meaning "every interface": not addresses to open


def browse_urls(host: str, port: int) -> list[str]:
    """The URLs to open for a server bound to `host`: that address's; for a wildcard bind, this
    machine's loopback address, then an address other machines can use (this machine's address on
    its default route, else its host name). http://0.0.0.0:8000, which uvicorn prints, is no
    address: some browsers and clients refuse it, and it names no machine to another one."""
    from nanochat.http_guard import server_url

    if host not in WILDCARDS:
        return [server_url(host, port)]
    return [server_url("127.0.0.1" if host == "0.0.0.0" else "::1", port),
            server_url(_outward_address(socket.AF_INET6 if host == "::" else socket.AF_INET), port)]


def _outward_address(family: int) -> str:
    """This machine's address on the route to a documentation-only address (RFC 5737 / 3849): a UDP
    connect picks the interface and sends nothing. Its host name when there is no such route."""
    target = ("2001:db8::1", 9) if family == socket.AF_INET6 else ("192.0.2.1", 9)
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(target)
            address = s.getsockname()[0]
    except OSError:   # no route (an offline machine), or no IPv6
        return socket.gethostname()
    return address if not address.startswith(("127.", "::1", "0.")) else socket.gethostname()


class DrainOnSignal:
    """The app as uvicorn.run serves it: Ctrl-C / SIGTERM first drains it (create_app's
    app.state.drain, STOP_EARLY_S before uvicorn's grace period ends; a second signal: at once),
    then uvicorn's own handler stops the server. Without it uvicorn cancels the answers still
    running when its grace period ends: their clients see a connection cut mid-answer. uvicorn
    installs its handlers as it starts serving, before it calls the app (lifespan startup): the
    first call wraps them (main thread only: signals are delivered there); uvicorn restores its
    predecessors when it stops. SIGHUP, which uvicorn leaves alone, goes to its SIGTERM handler
    (module docstring); run_server puts SIGHUP's handler back unless a hangup came."""

    def __init__(self, app, grace_s: float = GRACE_S):
        self.app, self.grace_s, self.hooked, self.signals, self.hung_up = app, grace_s, False, 0, False

    async def __call__(self, scope, receive, send):
        if not self.hooked and threading.current_thread() is threading.main_thread():
            self.hooked = True
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                handler = signal.getsignal(sig)
                if callable(handler):
                    signal.signal(sig, functools.partial(self._on_signal, loop, handler))
            hup, term = getattr(signal, "SIGHUP", None), signal.getsignal(signal.SIGTERM)
            if hup is not None and signal.getsignal(hup) is not signal.SIG_IGN and callable(term):
                from nanochat.loop import move_output_off_terminal   # imported here, not in the handler

                signal.signal(hup, functools.partial(self._on_hangup, move_output_off_terminal, term))
        await self.app(scope, receive, send)

    def _on_hangup(self, move_output, term_handler, sig, frame) -> None:
        """SIGHUP: the terminal is gone. Ignore a second one (the kernel's, as the session leader
        exits, must not kill the drain), move the output off the terminal, then stop as on SIGTERM
        (uvicorn records a SIGTERM: the one it re-raises at the end meets _after_shutdown)."""
        self.hung_up = True
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        move_output("the terminal hung up (SIGHUP): the server shuts down")
        term_handler(signal.SIGTERM, frame)

    def _on_signal(self, loop, handler, sig, frame) -> None:
        self.signals += 1   # (from uvicorn's SIGTERM handler as wrapped here, SIGHUP too)
        stop_after = max(self.grace_s - STOP_EARLY_S, 0.0) if self.signals == 1 else 0.0
        loop.call_soon_threadsafe(self.app.state.drain, stop_after)   # the loop's thread, not mid-callback
        handler(sig, frame)


_FINISH = re.compile(rb'"finish_reason":"([a-z_]+)"')
_JSON_KEEP = 1 << 20   # bytes of a JSON answer kept to read its usage / error code (a larger one: not read)


class RequestLog:
    """ASGI middleware: one line per HTTP request as its response ends, on uvicorn's logger, in place
    of uvicorn's access log (which logs as a response starts: a stream's 200 before its first word,
    no duration, and an answer that then failed or was stopped read like any other). E.g.

        127.0.0.1:51234 - "POST /v1/chat/completions" 200 in 2.410 s (stream, first token 0.118 s): stop, 31+87 tokens
        127.0.0.1:51236 - "POST /v1/chat/completions" 200 in 4.003 s (stream): error server_shutting_down
        127.0.0.1:51240 - "POST /v1/chat/completions" 400 in 0.004 s: error invalid_value
        127.0.0.1:51242 - "POST /v1/chat/completions" 200 in 0.870 s (stream, first token 0.100 s): client left

    Read from the answer itself: finish reasons, the error code (a 4xx/5xx body, or a stream's error
    event), the usage (prompt+completion tokens) of a non-streamed answer, or of a stream (from its
    last chunk when it asked for stream_options.include_usage, else as the server leaves it in the
    request's scope under USAGE_SCOPE_KEY). INFO; a 5xx or a stream ending in an error: WARNING; a
    successful /health probe (a load balancer's, every few seconds): DEBUG."""

    def __init__(self, app, logger: logging.Logger | None = None):
        self.app, self.log = app, logger or logging.getLogger("uvicorn.error")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = _Answer(time.perf_counter())

        async def send_seen(message):
            seen.note(message)
            await send(message)
        try:
            await self.app(scope, receive, send_seen)
        except BaseException as e:
            seen.failed = type(e).__name__
            raise
        finally:
            if seen.usage is None and isinstance(scope.get(USAGE_SCOPE_KEY), dict):
                seen.usage = scope[USAGE_SCOPE_KEY]
            self._log(scope, seen)

    def _log(self, scope, seen: _Answer) -> None:
        client = scope.get("client")
        who = _printable(f"{client[0]}:{client[1]}") if client else "-"   # (a proxy's X-Forwarded-For)
        path = _printable(scope.get("path", "")[:200])
        line, level = seen.describe()
        if (seen.status is not None and seen.status >= 500) or (seen.error is not None and seen.stream):
            level = logging.WARNING
        elif path == "/health" and seen.status is not None and seen.status < 300:
            level = logging.DEBUG
        if self.log.isEnabledFor(level):
            self.log.log(level, '%s - "%s %s" %s', who, scope.get("method", ""), path, line)


# Characters that end or rewrite a log line (C0 / C1 controls, DEL, Unicode line separators). A
# request's path is the client's text, percent-decoded by uvicorn: "/x%0A127.0.0.1:1 - ..." put a
# forged request line into the log, and "%1B[2J" cleared the terminal it was read on.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _printable(text: str) -> str:
    """`text` with each _UNPRINTABLE character as a Python escape ("\\n", "\\x1b")."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)


class _Answer:
    """What RequestLog reads from one response's messages as they pass."""

    def __init__(self, t0: float):
        self.t0, self.status, self.stream, self.json, self.first_token = t0, None, False, False, None
        self.ended, self.failed, self.error, self.usage = False, None, None, None
        self.finishes: list[str] = []
        self.body, self.body_size = [], 0

    def note(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            ctype = dict(message.get("headers", ())).get(b"content-type", b"")
            self.stream = ctype.startswith(b"text/event-stream")
            self.json = ctype.startswith(b"application/json")
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if self.stream:
                self._sse(body)
            elif self.json and self.body_size + len(body) <= _JSON_KEEP:
                self.body.append(body)
            self.body_size += len(body)
            self.ended = not message.get("more_body", False)

    def _sse(self, body: bytes) -> None:
        if self.first_token is None and b'"delta":{"content":' in body:
            self.first_token = time.perf_counter() - self.t0
        self.finishes += [m.decode() for m in _FINISH.findall(body)]
        if b'data: {"error":' in body or b'"usage":{' in body:
            for line in body.split(b"\n"):
                if line.startswith(b"data: {"):
                    self._read(json.loads(line[6:]))

    def _read(self, answer) -> None:
        if not isinstance(answer, dict):
            return
        error = answer.get("error")
        if isinstance(error, dict):
            self.error = error.get("code") or error.get("type") or "error"
        if isinstance(answer.get("usage"), dict):
            self.usage = answer["usage"]
        if not self.stream:   # (a stream's finish reasons: _FINISH, chunk by chunk)
            for choice in answer.get("choices") or ():
                if isinstance(choice, dict) and choice.get("finish_reason"):
                    self.finishes.append(choice["finish_reason"])

    def describe(self) -> tuple[str, int]:
        """The line's tail (after method and path) and its level before RequestLog's adjustments."""
        if self.body and self.ended:
            try:
                self._read(json.loads(b"".join(self.body)))
            except ValueError:
                pass
        took = time.perf_counter() - self.t0
        how = []
        if self.stream:
            how.append("stream")
        if self.first_token is not None:
            how.append(f"first token {self.first_token:.3f} s")
        head = f"{self.status if self.status is not None else '-'} in {took:.3f} s"
        head += f" ({', '.join(how)})" if how else ""
        if self.failed is not None:
            what = f"failed ({self.failed})" if self.failed not in ("CancelledError",) else "client left"
        elif not self.ended or self.status == 499:
            what = "client left"
        elif self.error is not None:
            what = f"error {self.error}"
        else:
            parts = []
            if self.finishes:
                counts = {f: self.finishes.count(f) for f in dict.fromkeys(self.finishes)}
                parts.append(", ".join(f if c == 1 else f"{c} {f}" for f, c in counts.items()))
            if self.usage is not None:
                parts.append(f"{self.usage.get('prompt_tokens')}+{self.usage.get('completion_tokens')} tokens")
            what = "; ".join(parts)
        return (f"{head}: {what}" if what else head), logging.INFO


def _after_shutdown(sig, frame) -> None:
    """SIGINT's and SIGTERM's handler around uvicorn.run: uvicorn raises the signals that stopped it
    again once it has shut down, for the handlers it found; the default ones would end a clean
    shutdown as killed by SIGTERM, or with a KeyboardInterrupt traceback after a second Ctrl-C."""


def run_server(app, host: str, port: int, log_level: str = "warning", grace_s: float | None = None) -> None:
    """Serve `app` (nanochat.server.create_app's) with uvicorn until Ctrl-C / SIGTERM, then shut it
    down in order (module docstring) and return. grace_s: None = GRACE_S."""
    import uvicorn

    from nanochat.http_guard import uvicorn_options

    grace_s = GRACE_S if grace_s is None else grace_s
    # signal handlers can be set only in the main thread; uvicorn replaces these while it serves
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    hup = getattr(signal, "SIGHUP", None)
    hup_before = signal.getsignal(hup) if main_thread and hup is not None else None
    drain = DrainOnSignal(app, grace_s)
    try:
        # RequestLog's line per request replaces uvicorn's access log (access_log=False); the
        # protocol times out slow headers, caps one address's connections and a request head's
        # size; no WebSockets (http_guard.uvicorn_options, with the app's connection limit)
        uvicorn.run(RequestLog(drain), host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=grace_s, access_log=False, **uvicorn_options(app))
        app.state.finish()   # the generation threads drain stopped end before the process does
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if hup_before is not None and not drain.hung_up:   # after a hangup it stays ignored
            signal.signal(hup, hup_before)
