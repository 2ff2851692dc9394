"""The OpenAI shape of a chat completion's streamed answer: SSE framing (`_sse`), the
chat.completion.chunk events of a running generation job (`_sse_events`: one choice per chunk,
finish reasons, usage, [DONE]) and the count of how each request ended (`_count_end`, shared with
the non-streamed answer). nanochat/server.py runs the jobs (`_Job`) and the app; it imports these.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from nanochat.chat_api import ApiError

if TYPE_CHECKING:
    from nanochat.server import _Job


# Characters str.splitlines() ends a line at that JSON leaves raw (it escapes the C0 controls): a
# line-based client (httpx's iter_lines, requests' iter_lines(decode_unicode=True)) would cut a
# `data:` line there. SSE itself ends lines only at CR/LF; escaped, the JSON means the same.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


# Seconds of silence after which a stream sends an SSE comment: a request waiting for a replica,
# or (batching) for free rows, or a long prefill, still gets bytes, so a client's or proxy's read
# timeout does not end it (and a gone client is noticed when the write fails).
KEEPALIVE_S = 2.0


def _sse(obj) -> str:
    data = json.dumps(obj, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


def _choice(i: int, delta: dict, finish: str | None = None) -> dict:
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}


def _count_end(job: _Job, event: tuple) -> None:
    """The request side read `job`'s final event: its outcome, counted once (event loop)."""
    job.ended = True
    job.stats["completed" if event[0] == "done" else "errors"] += 1
    if event[0] == "done":
        job.usage = event[2]
        job.stats["completion_tokens"] += event[2]["completion_tokens"]


async def _sse_events(job: _Job, meta: dict):
    """A started job's events as SSE chunks, ending with [DONE]. As OpenAI streams n > 1, a chunk
    carries one choice (a client may read only `choices[0]` and its index). A choice's finish
    chunk is sent as soon as it ends (n > 1: the others go on); "done" finishes the rest (length);
    an "error" or "abort" ends it with an error event in OpenAI's shape."""
    def chunks(choices: list) -> str:
        return "".join(chunk([c]) for c in choices)

    def chunk(choices: list, usage=None) -> str:
        out = {**meta, "object": "chat.completion.chunk", "choices": choices}
        if job.req.include_usage:  # as OpenAI: "usage" on every chunk, null but on the last
            out["usage"] = usage
        return _sse(out)
    yield chunks([_choice(i, {"role": "assistant", "content": ""}) for i in range(job.req.n)])
    ended = set()
    while True:
        if not job.events.empty():   # the common case mid-stream: no task, no timer (~1 vs ~40 us)
            event = job.events.get_nowait()
        else:
            getter = asyncio.ensure_future(job.events.get())
            try:
                while not (await asyncio.wait({getter}, timeout=KEEPALIVE_S))[0]:
                    yield ": waiting for the model\n\n"   # SSE comment (KEEPALIVE_S)
            finally:
                if not getter.done():   # the stream was closed while it waited
                    getter.cancel()
            event = getter.result()
        if event[0] == "delta":
            if event[1]:
                yield chunks([_choice(i, {"content": t}) for i, t in event[1]])
            if event[2]:
                yield chunks([_choice(i, {}, f) for i, f in event[2]])
                ended.update(i for i, _ in event[2])
        elif event[0] == "done":
            _count_end(job, event)
            left = [_choice(i, {}, f) for i, f in enumerate(event[1]) if i not in ended]
            if left:
                yield chunks(left)
            if job.req.include_usage:
                yield chunk([], event[2])
            break
        elif event[0] == "abort":   # stopped by the server (shutting down): its error, counted as cancelled
            yield _sse(event[1].body())
            break
        else:
            _count_end(job, event)
            yield _sse(ApiError(500, event[1]).body())
            break
    yield "data: [DONE]\n\n"
