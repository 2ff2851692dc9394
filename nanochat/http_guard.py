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
"""

import asyncio
import base64
import hashlib
import json
import re
from urllib.parse import urlsplit

from nanochat.chat_api import ApiError


_PORT = re.compile(r":[0-9]{1,5}")

# Seconds a client has to send a whole request body once its headers came: a client that declares
# a body and then trickles it (or stalls, slowloris-style) gets a 408 and its connection back,
# instead of holding a connection and a handler for as long as it likes.
BODY_TIMEOUT_S = 30.0
# On an answer given before the body was read (408, 413): the connection ends with it, so the server
# does not go on reading (and discarding) the rest of an oversized or trickled body.
_CLOSE = {"Connection": "close"}


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
    if not length.isdigit():
        raise ApiError(400, "invalid Content-Length header")
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
