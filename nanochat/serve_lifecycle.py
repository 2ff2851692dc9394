"""A chat server process's start and stop, shared by scripts/chat_web.py and the server that
scripts/load_test.py starts: the port check before the model loads, and uvicorn run so that
Ctrl-C / SIGTERM shut it down in order (new and queued requests get a 503 `server_shutting_down`
at once, answers in progress get GRACE_S - STOP_EARLY_S seconds and then end with that error,
never a cut connection; the process returns 0 instead of dying of the re-raised signal)."""

from __future__ import annotations

import asyncio
import functools
import signal
import threading

GRACE_S = 5         # uvicorn's graceful shutdown: how long answers in progress get after Ctrl-C / SIGTERM
STOP_EARLY_S = 1.0  # running generations are stopped this long before it ends, so each ends properly


def check_port_free(host: str, port: int, flag: str = "--host/--port") -> None:
    """RequestError naming `flag` when nothing can listen on host:port (another server has it):
    said before the model loads and warms up (minutes on a GPU), not after, as uvicorn would."""
    import socket

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


class DrainOnSignal:
    """The app as uvicorn.run serves it: Ctrl-C / SIGTERM first drains it (create_app's
    app.state.drain, STOP_EARLY_S before uvicorn's grace period ends; a second signal: at once),
    then uvicorn's own handler stops the server. Without it uvicorn cancels the answers still
    running when its grace period ends: their clients see a connection cut mid-answer. uvicorn
    installs its handlers as it starts serving, before it calls the app (lifespan startup): the
    first call wraps them (main thread only: signals are delivered there); uvicorn restores its
    predecessors when it stops."""

    def __init__(self, app, grace_s: float = GRACE_S):
        self.app, self.grace_s, self.hooked, self.signals = app, grace_s, False, 0

    async def __call__(self, scope, receive, send):
        if not self.hooked and threading.current_thread() is threading.main_thread():
            self.hooked = True
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                handler = signal.getsignal(sig)
                if callable(handler):
                    signal.signal(sig, functools.partial(self._on_signal, loop, handler))
        await self.app(scope, receive, send)

    def _on_signal(self, loop, handler, sig, frame) -> None:
        self.signals += 1
        stop_after = max(self.grace_s - STOP_EARLY_S, 0.0) if self.signals == 1 else 0.0
        loop.call_soon_threadsafe(self.app.state.drain, stop_after)   # the loop's thread, not mid-callback
        handler(sig, frame)


def _after_shutdown(sig, frame) -> None:
    """SIGINT's and SIGTERM's handler around uvicorn.run: uvicorn raises the signals that stopped it
    again once it has shut down, for the handlers it found; the default ones would end a clean
    shutdown as killed by SIGTERM, or with a KeyboardInterrupt traceback after a second Ctrl-C."""


def run_server(app, host: str, port: int, log_level: str = "warning", grace_s: float | None = None) -> None:
    """Serve `app` (nanochat.server.create_app's) with uvicorn until Ctrl-C / SIGTERM, then shut it
    down in order (module docstring) and return. grace_s: None = GRACE_S."""
    import uvicorn

    grace_s = GRACE_S if grace_s is None else grace_s
    # signal handlers can be set only in the main thread; uvicorn replaces these while it serves
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    try:
        uvicorn.run(DrainOnSignal(app, grace_s), host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=grace_s)
        app.state.finish()   # the generation threads drain stopped end before the process does
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
