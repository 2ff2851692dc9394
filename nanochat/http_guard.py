"""HTTP-level guards of the chat server (nanochat/server.py), checked before a request reaches the
model: the Host header (DNS rebinding), the Content-Type of a POST (cross-site "simple" requests),
the body size and JSON, the chat page's Content-Security-Policy, and the CORS middleware
(refused preflights as the API's JSON errors).

Why they matter for a server on a user's own machine: any web page the user opens can send
requests to http://127.0.0.1:8000. The browser's same-origin policy stops it from reading the
answers, but two holes remain. (1) DNS rebinding: the page's own name (evil.example) is re-pointed
at 127.0.0.1, so the browser treats the server as same-origin and lets the page read everything;
its requests still say `Host: evil.example`, which `HostGuard` refuses. (2) A cross-site form or
fetch can POST without a CORS preflight only with text/plain, form-urlencoded or multipart bodies,
or with no Content-Type at all (a Blob body); `require_json` refuses the first three, and
`HostGuard` refuses a POST whose Origin header names a page that is neither on an allowed host nor a
`--cors-origin`, so such a page cannot make the server generate at all. Browsers always send Origin
on a cross-origin POST; curl and the openai client send none and are not affected.

Below the app, at the connection (`guarded_protocol`, the uvicorn HTTP protocol chat_web serves
with): uvicorn has no timeout for a request's headers (its keep-alive timer runs only between
requests, and the first byte cancels it), so a client that connects and sends nothing, or trickles
its headers a byte at a time (slowloris), held a connection and a file descriptor for ever; and
nothing bounded how many connections one address could hold open; a request head (request line
and headers) could take 256 KiB (h11's default) and was then refused in plain text: it is now
MAX_HEADER_BYTES, refused with a JSON 431, and any request the parser cannot read gets a JSON 400.
"""

import asyncio
import base64
import hashlib
import ipaddress
import json
import logging
import re
from urllib.parse import urlsplit

from nanochat.chat_api import ApiError


_PORT = re.compile(r":[0-9]{1,5}")

# Seconds a client has to send a whole request body once its headers came: a client that declares
# a body and then trickles it (or stalls, slowloris-style) gets a 408 and its connection back,
# instead of holding a connection and a handler for as long as it likes.
BODY_TIMEOUT_S = 30.0
# Seconds a connection has to send a whole request line and headers, from its opening or from the
# end of its previous response (uvicorn's own keep-alive timeout closes an idle one sooner, 5 s).
# Headers are a few hundred bytes that every client sends at once; 10 s is generous on a slow link.
HEADER_TIMEOUT_S = 10.0
# On an answer given before the body was read (408, 413): the connection ends with it, so the server
# does not go on reading (and discarding) the rest of an oversized or trickled body.
_CLOSE = {"Connection": "close"}
# Bytes a request line and its headers may take (431 past it). h11's own buffer limit, which uvicorn
# leaves at 256 KiB, let every connection hold a quarter megabyte of headers, and its refusal was a
# plain-text 400 with the connection reset under it. 32 KiB is nginx's default total for a request
# head (4 x 8 KiB) and twice Node's: a big Cookie header on localhost (every local app's cookies go
# to every port) still fits.
MAX_HEADER_BYTES = 32 * 1024
_HEAD_END = re.compile(rb"\n\r?\n")   # the blank line that ends a request head (CRLF, or bare LF as h11 reads it)
# After a connection-level refusal (431, an unparsable request): the answer is sent, the write side
# closed, and what the client is still sending read and dropped for up to LINGER_S seconds or
# _LINGER_BYTES bytes before the socket closes. Closed at once with unread bytes, the kernel
# answered with a reset that discarded the error before the client read it.
LINGER_S = 2.0
_LINGER_BYTES = 1 << 20


def host_of(header: str) -> str:
    """The host part of a Host header, lowercased: "[::1]:8000" -> "::1", "LocalHost:80" -> "localhost".
    A port that is not digits ("127.0.0.1:80@evil.example") leaves the header whole, which names
    no allowed host."""
    host = header.strip().lower()
    if host.startswith("[") and "]" in host:
        end = host.index("]")
        if end + 1 < len(host) and not _PORT.fullmatch(host[end + 1:]):
            return host
        host = host[1:end]
    elif host.count(":") == 1:           # name:port or v4:port (a bare IPv6 address has several colons)
        name, port = host.split(":")
        if not _PORT.fullmatch(":" + port):
            return host
        host = name
    return host.rstrip(".")              # "localhost." names the same host


def server_url(host: str, port: int) -> str:
    """The address to open for a bind host: an IPv6 literal in brackets ("::1" -> "http://[::1]:8000";
    "http://::1:8000" is not a URL a browser or curl reads)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def origin_allowed(origin: str, allowed_hosts, origins) -> bool:
    """A page at `origin` may send requests that act (POST): it is a --cors-origin, or it is served
    from one of the allowed hosts (the chat page itself, another app on this machine). An opaque
    origin ("null": sandboxed frames, file:// pages) is not."""
    if origin in origins:
        return True
    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host is not None and host_of(host) in allowed_hosts


class HostGuard:
    """ASGI middleware, one check for all routes (/health and the page included): a request whose
    Host header's host is not in `allowed` gets a 400 JSON error (DNS rebinding); a POST whose
    Origin header fails `origin_allowed` gets a 403 (a cross-site page driving the model)."""

    def __init__(self, app, allowed, origins=()):
        self.app, self.allowed, self.origins = app, frozenset(host_of(h) for h in allowed), frozenset(origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                from starlette.responses import JSONResponse

                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> ApiError | None:
        headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in (b"host", b"origin")}
        host = headers.get(b"host", "")
        if host_of(host) not in self.allowed:
            return ApiError(400, f"Host header {host!r} is not allowed by this server (allowed: "
                                 f"{', '.join(sorted(self.allowed))}; add a name with chat_web --allowed-host)",
                            code="invalid_host")
        origin = headers.get(b"origin")
        if scope["method"] not in ("GET", "HEAD", "OPTIONS") and origin is not None \
                and not origin_allowed(origin, self.allowed, self.origins):
            return ApiError(403, f"Origin {origin!r} may not send requests to this server (pages on "
                                 f"{', '.join(sorted(self.allowed))} may; allow a web app with chat_web "
                                 "--cors-origin)", code="invalid_origin")
        return None


def json_cors_middleware():
    """Starlette's CORSMiddleware, but a refused preflight is the API's JSON 400 (code
    "cors_preflight_refused", naming what was refused and what is allowed) instead of its plain-text
    "Disallowed CORS origin": every 4xx of this server is OpenAI-shaped. Built on first use (starlette
    is the web extra's; no import at module load)."""
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import JSONResponse

    class JsonCORSMiddleware(CORSMiddleware):
        def preflight_response(self, request_headers):
            response = super().preflight_response(request_headers)
            if response.status_code != 400:
                return response
            refused = response.body.decode().removeprefix("Disallowed CORS ")
            origin, method = request_headers["origin"], request_headers["access-control-request-method"]
            error = ApiError(400, f"CORS preflight refused ({refused}) for origin {origin!r}, method {method!r}: "
                                  f"this server lets the origins {', '.join(sorted(self.allow_origins)) or '(none)'} "
                                  f"(chat_web --cors-origin) use the methods {', '.join(self.allow_methods)}",
                             code="cors_preflight_refused")
            headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
            return JSONResponse(error.body(), status_code=400, headers=headers)
    return JsonCORSMiddleware


def require_json(request) -> None:
    """415 unless the Content-Type is application/json (parameters like charset allowed). A missing
    header is accepted for minimal clients; the three types a cross-site page may send without a
    CORS preflight (text/plain, application/x-www-form-urlencoded, multipart/form-data) are not."""
    ctype = request.headers.get("content-type")
    if ctype is None or ctype.split(";")[0].strip().lower() == "application/json":
        return
    raise ApiError(415, f"Content-Type {ctype!r} is not accepted: send the body as JSON with "
                        "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')",
                   code="unsupported_media_type")


async def read_json(request, limit: int):
    """The body as JSON, refusing more than `limit` bytes before reading them all (413), and a body
    not received within BODY_TIMEOUT_S (408)."""
    length = request.headers.get("content-length", "0")
    # isascii: str.isdigit() alone passes "²" (the header's latin-1 byte 0xB2), which int() refused: a 500
    if not (length.isascii() and length.isdigit()):
        raise ApiError(400, "invalid Content-Length header", code="invalid_content_length")
    if int(length) > limit:
        raise ApiError(413, f"request body is {length} bytes; the limit is {limit}", code="body_too_large",
                       headers=_CLOSE)
    chunks = []

    async def receive():
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large",
                               headers=_CLOSE)
            chunks.append(chunk)
    from starlette.requests import ClientDisconnect

    try:
        await asyncio.wait_for(receive(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {BODY_TIMEOUT_S:g} s; send it whole, "
                            "without pauses", code="request_timeout", headers=_CLOSE) from None
    except ClientDisconnect:   # the client left mid-body: nobody reads the answer, and no server error
        raise ApiError(499, "the client closed the connection before sending the whole body",
                       code="client_disconnected") from None
    return parse_json_body(b"".join(chunks))


def parse_json_body(raw: bytes):
    """`raw` as JSON; ApiError(400, invalid_json) that says what is wrong and where: a bare "could
    not parse JSON" left a client with a hand-written body (a trailing comma, a quote lost to shell
    quoting, an empty `curl -X POST`) to guess which of its bytes the server meant."""
    def refuse(why: str):
        raise ApiError(400, f"request body: could not parse JSON: {why}; accepted: a JSON object "
                            "(e.g. {\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]})", code="invalid_json")
    if not raw.strip():
        refuse("the body is empty")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:   # a ValueError: first
        refuse(f"{e.msg} at line {e.lineno} column {e.colno}")
    except UnicodeDecodeError as e:
        refuse(f"byte {e.start} is not UTF-8 (send the body UTF-8 encoded)")
    except RecursionError:
        refuse("nested too deeply")
    except ValueError as e:   # e.g. an integer literal longer than Python's 4300-digit limit
        refuse(str(e).split("; use")[0])


def csp(html: str) -> str:
    """A Content-Security-Policy allowing exactly the page's own inline <script>/<style> blocks
    (by hash): even if model text ever reached the DOM as HTML, no injected script could run."""
    def hashes(tag):
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                        for b in blocks)
    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")


def default_connections_per_client(per_client: int) -> int:
    """Open connections one (non-loopback) address may hold when --max-connections-per-client is
    not given: twice its concurrent requests (a client pool's idle keep-alive connections beside the
    busy ones), at least 256 (many users behind one NAT address)."""
    return max(256, 2 * per_client)


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)   # "::ffff:127.0.0.1" on a dual-stack "::" bind
    return (mapped or address).is_loopback


def client_key(host: str, ipv6_prefix: int = 64) -> str:
    """The client a peer address counts as: an IPv4 address (also when IPv4-mapped on a dual-stack
    bind), or an IPv6 address's /`ipv6_prefix`. The connection cap counts a /64, which one site gets
    whole (one host picks a new address in it at will, so a per-address cap did not hold one machine);
    the concurrent-request limit passes 128, the address itself: every host of an IPv6 LAN shares
    its /64, and counted by it they shared one small request budget (the connection cap is 256)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 4:
        return str(address)
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    if address.is_loopback or ipv6_prefix >= 128:
        return str(address)
    return str(ipaddress.ip_network(f"{address}/{ipv6_prefix}", strict=False))


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response with the API's JSON body, written straight to a transport
    that is closed next (no request cycle exists to answer through)."""
    body = json.dumps(ApiError(status, message, code=code).body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def guarded_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, max_connections_per_client: int | None = None,
                     max_header_bytes: int = MAX_HEADER_BYTES):
    """uvicorn's HTTP protocol class (h11, or httptools where installed) with connection-level
    guards, for uvicorn's `http=` (`uvicorn_options`, which nanochat/serve_lifecycle.py's run_server
    and server.py's serve_in_thread serve with):

    - a connection whose request line and headers have not all arrived `header_timeout_s` after it
      opened, or after its previous response ended, is closed: with a 408 JSON error when part of a
      request came (a slow client learns why), silently when nothing did. A request in progress
      (a long stream, a body being read: the app's own BODY_TIMEOUT_S) is never cut by it.
    - an address (`client_key`: an IPv6 one's /64) holding `max_connections_per_client` open
      connections has the next one answered with a 429 and closed at once (None: no limit).
      Loopback peers are not counted: they are this machine's own users or a reverse proxy in
      front of the server, which carries every user.
    - a request head (request line and headers) over `max_header_bytes` is answered with a JSON
      431 `request_headers_too_large` once that many bytes came without its end (after the answer
      in progress, if one is: answers go in order), and the connection closes (after LINGER_S, reading what the client still sends, so it reads the
      answer). Counted here, before the parser, whichever parser it is; what this count cannot
      place (the start of a head read with the end of the previous request, a head after an
      answer given before its request's body was read) is the parser's to bound: h11's buffer
      limit (`uvicorn_options`), refused as the same 431 (httptools has no settable limit).
      Any other request the parser rejects is a JSON 400 `invalid_http_request` (uvicorn's was
      plain text), so every error of this server is OpenAI-shaped.

    Built on first use: uvicorn is the web extra's (no import at module load). The class keeps its
    counts per call: one call per server."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s: got {header_timeout_s!r}; accepted: a number of seconds > 0")
    if isinstance(max_header_bytes, bool) or not isinstance(max_header_bytes, int) or max_header_bytes < 1024:
        raise ValueError(f"max_header_bytes: got {max_header_bytes!r}; accepted: an integer >= 1024")
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    header_timeout, max_connections, max_head = header_timeout_s, max_connections_per_client, max_header_bytes
    open_by_address: dict[str, int] = {}
    warned: set[str] = set()   # addresses refused since they were last under the limit: logged once
    log = logging.getLogger("uvicorn.error")
    too_large = (431, "Request Header Fields Too Large", f"the request line and headers exceed this server's limit of "
                 f"{max_header_bytes} bytes; send smaller headers (a browser: clear this site's cookies)",
                 "request_headers_too_large")

    class GuardedHTTPProtocol(AutoHTTPProtocol):
        header_timeout_s, max_connections_per_client = header_timeout, max_connections   # (read only)
        max_header_bytes = max_head
        _header_timer = None
        _counted: str | None = None   # the address this connection is counted under
        _partial = False              # bytes came since the timer was armed
        _refused = False              # an error was sent: what comes now is read and dropped (LINGER_S)
        _refuse_after = None          # an error to send once the answer in progress ends (answers go in order)
        _dropped = 0
        # the request head being counted (_head_too_large): the cycle it follows (None: the
        # connection's first), its bytes so far, whether its blank line came, the last bytes seen
        _head_after, _head_bytes, _head_done, _head_tail = None, 0, False, b""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            address = client_key(self.client[0]) if self.client else None
            if max_connections_per_client is not None and address is not None and not _is_loopback(address):
                if open_by_address.get(address, 0) >= max_connections_per_client:
                    if address not in warned:
                        warned.add(address)
                        log.warning("%s has %d connections open (chat_web --max-connections-per-client): "
                                    "refusing more", address, max_connections_per_client)
                    transport.write(_raw_error(429, "Too Many Requests", "too many open connections from this address "
                                               f"(limit {max_connections_per_client}, the server's "
                                               "--max-connections-per-client); reuse or close some",
                                               "too_many_connections"))
                    transport.close()
                    return
                self._counted = address
                open_by_address[address] = open_by_address.get(address, 0) + 1
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._refused or self._refuse_after:   # after an error (LINGER_S): dropped, up to _LINGER_BYTES
                self._dropped += len(data)
                if self._dropped > _LINGER_BYTES:
                    self.transport.close()
                return
            self._partial = True   # (a request in progress: the timer checks that first)
            if self._head_too_large(data):
                log.warning("%s sent a request head over %d bytes: refused (431)",
                            self.client[0] if self.client else "-", max_header_bytes)
                if self.cycle is not None and not self.cycle.response_complete:
                    self._refuse_after = too_large   # a head pipelined behind an answer: after that answer
                    self.flow.pause_reading()
                else:
                    self._refuse(*too_large)
                return
            super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            """The parser rejected the request (uvicorn logged it): h11 over its buffer limit is
            the 431; anything else a JSON 400 in place of uvicorn's plain text."""
            buffered = getattr(getattr(self, "conn", None), "trailing_data", (b"",))[0]   # h11's unparsed bytes
            error = too_large if len(buffered) > max_header_bytes else (
                400, "Bad Request", "invalid HTTP request: the request line or headers could not be parsed; send a "
                "valid HTTP/1.1 request", "invalid_http_request")
            cycle, queued = self.cycle, getattr(self, "pipeline", None)   # (httptools queues parsed requests)
            if queued or (cycle is not None and not cycle.response_complete and not cycle.more_body):
                # the bad bytes follow a request whose answer is due: it is answered first, then the
                # error ends the connection; queued requests are never started (one waiting for a body
                # that will not come would hold the connection open)
                if queued:
                    queued.clear()
                self._refuse_after = error
                self.flow.pause_reading()
            else:   # nothing due, or the current request's own body is bad: the error now
                self._refuse(*error)

        def _head_too_large(self, data: bytes) -> bool:
            """Counts `data` toward the request head it begins or continues, up to the head's blank
            line; True once the head passes max_header_bytes. Only once the last request's body is
            all read (answered or not: a head pipelined behind a long stream counts too); before
            that, the bytes are its body."""
            cycle = self.cycle
            if cycle is not None and cycle.more_body:
                return False
            if self._head_after is not cycle:   # the first bytes after this request: a new head
                self._head_after, self._head_bytes, self._head_done, self._head_tail = cycle, 0, False, b""
            if self._head_done:   # (the parser holds a head whose request has not started yet)
                return False
            window = self._head_tail + data
            end = _HEAD_END.search(window)
            self._head_bytes += end.end() - len(self._head_tail) if end else len(data)
            self._head_done, self._head_tail = end is not None, window[-2:]
            return self._head_bytes > max_header_bytes

        def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
            """Answer with a JSON error and end the connection: write side closed now, the socket
            after LINGER_S (or the client's own close), reading and dropping until then."""
            if self._refused:
                return
            self._refused = True
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True   # its app's later writes are dropped: none after write_eof
                if cycle.response_started:   # an answer is half sent: no error can follow it, only the close
                    self.transport.close()
                    return
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._unset_keepalive_if_required()   # uvicorn's keep-alive timer (both parsers have it)
            self.flow.resume_reading()
            self.transport.write(_raw_error(status, reason, message, code))
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()   # may start a pipelined request's cycle (or refuse it: h11)
            idle = self.cycle is None or self.cycle.response_complete   # httptools may have started the next
            if self._refuse_after is not None and idle and not self.transport.is_closing():
                self._refuse(*self._refuse_after)
            if not self._refused:
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            if self._counted is not None:
                left = open_by_address[self._counted] - 1
                if left:
                    open_by_address[self._counted] = left
                else:
                    del open_by_address[self._counted]
                if left < max_connections_per_client:
                    warned.discard(self._counted)
                self._counted = None
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._partial = False
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late, self.cycle)

        def _headers_late(self, cycle) -> None:
            """No new request began since the timer was armed (the same cycle, finished or none)."""
            if self.transport.is_closing() or self.cycle is not cycle or \
                    (cycle is not None and not cycle.response_complete):
                return
            if self._partial:
                self.transport.write(_raw_error(408, "Request Timeout", f"request headers not received within "
                                                f"{header_timeout_s:g} s; send the request whole, without pauses",
                                                "request_timeout"))
            self.transport.close()

    return GuardedHTTPProtocol


def uvicorn_options(app, header_timeout_s: float = HEADER_TIMEOUT_S) -> dict:
    """The uvicorn options the chat server runs `app` with (serve_lifecycle.run_server's
    uvicorn.run, server.serve_in_thread's Config): the guarded protocol with the app's connection
    limit (create_app leaves it on app.state; a wrapped app has none: no limit), h11's buffer
    limit at MAX_HEADER_BYTES (the backstop for a head the protocol does not count), and
    WebSockets off (`ws="none"`): no route takes one, and an upgraded connection left the protocol
    without its connection_lost, so its count stayed for good."""
    limit = getattr(getattr(app, "state", None), "max_connections_per_client", None)
    return {"http": guarded_protocol(header_timeout_s, limit), "ws": "none",
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES}
