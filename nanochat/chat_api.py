"""The chat API's request side: server limits (`ServerSettings`), OpenAI-shaped errors
(`ApiError`) and parsing/validation of a chat-completions body into a `ChatRequest`, all before any
model work. Split out of server.py, which owns the app, the replica pool and generation.
"""

import json
from dataclasses import asdict, dataclass

ROLES = ("system", "user", "assistant")


# ------------------------------------------------------------------------------------ settings

@dataclass
class ServerSettings:
    """Everything a client can influence is bounded by one of these."""

    model_name: str = "nanochat"
    api_key: str | None = None              # when set, /v1/* and /stats need "Authorization: Bearer <key>"
    max_messages: int = 100
    max_message_chars: int = 16_000
    max_total_chars: int = 64_000
    default_max_tokens: int = 512
    max_max_tokens: int = 4096
    default_temperature: float = 0.8
    default_top_k: int = 50
    max_temperature: float = 2.0
    max_top_k: int = 1000
    max_n: int = 4
    max_stop: int = 4                       # stop strings per request, each <= 100 chars
    max_body_bytes: int = 1 << 20
    max_concurrent_per_client: int = 4
    max_queue: int = 128                    # requests waiting for a replica before 503

    def validate(self) -> "ServerSettings":
        for name, value in asdict(self).items():
            if name in ("model_name", "api_key", "default_temperature", "max_temperature", "default_top_k"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')}: got {value!r}; accepted: an integer >= 1")
        if not 0 <= self.default_temperature <= self.max_temperature:
            raise ValueError(f"--temperature: got {self.default_temperature}; accepted: 0..{self.max_temperature}")
        if not 0 <= self.default_top_k <= self.max_top_k:
            raise ValueError(f"--top-k: got {self.default_top_k}; accepted: 0..{self.max_top_k} (0 = off)")
        if self.default_max_tokens > self.max_max_tokens:
            raise ValueError(f"--max-tokens: got {self.default_max_tokens}; accepted: 1..{self.max_max_tokens}")
        if self.api_key is not None and len(self.api_key) < 8:
            raise ValueError("--api-key: got a key shorter than 8 characters; accepted: >= 8 characters")
        return self

    def public(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "api_key"} | {"auth": self.api_key is not None}


class ApiError(Exception):
    """An error returned to the client as {"error": {...}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A validated request; messages normalised to {"role", "content": str}."""

    messages: list[dict]
    stream: bool
    include_usage: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    max_tokens: int | None
    stop: tuple[str, ...]
    n: int
    seed: int | None


# ------------------------------------------------------------------------------------ request parsing

def _number(body: dict, name: str, low: float, high: float, default, *, integer=False, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if ok and not (low < value if low_open else low <= value) or ok and value > high:
        ok = False
    if not ok:
        span = f"{'(' if low_open else '['}{low}, {high}]"
        raise ApiError(400, f"'{name}': got {json.dumps(value)}; accepted: {'an integer' if integer else 'a number'} "
                            f"in {span}", param=name, code="invalid_value")
    return value


def _content_text(content, i: int) -> str:
    """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"'messages[{i}].content': accepted: a string or a list of "
                        "{\"type\": \"text\", \"text\": string} parts", param=f"messages[{i}].content")


def _parse_messages(raw, s: ServerSettings) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages': accepted: a non-empty list of {role, content}", param="messages")
    if len(raw) > s.max_messages:
        raise ApiError(400, f"'messages': got {len(raw)} messages; the limit is {s.max_messages}",
                       param="messages", code="too_many_messages")
    out, total = [], 0
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise ApiError(400, f"'messages[{i}].role': got {json.dumps(role)}; accepted: system|user|assistant",
                           param=f"messages[{i}].role")
        text = _content_text(m.get("content"), i)
        if len(text) > s.max_message_chars:
            raise ApiError(400, f"'messages[{i}].content': {len(text)} characters; the limit is "
                                f"{s.max_message_chars}", param=f"messages[{i}].content", code="message_too_long")
        total += len(text)
        out.append({"role": role, "content": text})
    if total > s.max_total_chars:
        raise ApiError(400, f"'messages': {total} characters in total; the limit is {s.max_total_chars}",
                       param="messages", code="messages_too_long")
    turns = out[1:] if out[0]["role"] == "system" else out
    for k, m in enumerate(turns):
        want = "user" if k % 2 == 0 else "assistant"
        if m["role"] != want:
            i = k + len(out) - len(turns)
            raise ApiError(400, f"'messages[{i}].role': got '{m['role']}', expected '{want}' (a system message may "
                                "only come first; then user and assistant alternate, starting with user)",
                           param=f"messages[{i}].role")
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "'messages': the last message must be from the user", param="messages")
    return out


def parse_chat_request(body, s: ServerSettings) -> ChatRequest:
    """Validate a /v1/chat/completions body against the limits; ApiError(400) names the field.
    Unknown fields (e.g. presence_penalty) are ignored, as most OpenAI-compatible servers do."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body: accepted: a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model': accepted: a string", param="model")
    messages = _parse_messages(body.get("messages"), s)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream': accepted: true|false", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options': accepted: {\"include_usage\": true|false}", param="stream_options")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", 1, s.max_max_tokens, None, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > s.max_stop or \
            not all(isinstance(x, str) and 0 < len(x) <= 100 for x in stop):
        raise ApiError(400, f"'stop': accepted: a string or a list of up to {s.max_stop} non-empty strings "
                            "of <= 100 characters", param="stop")
    return ChatRequest(
        messages=messages, stream=stream, include_usage=bool(opts.get("include_usage", False)),
        temperature=float(_number(body, "temperature", 0, s.max_temperature, s.default_temperature)),
        top_k=_number(body, "top_k", 0, s.max_top_k, s.default_top_k, integer=True) or None,
        top_p=_number(body, "top_p", 0, 1, None, low_open=True), max_tokens=max_tokens, stop=tuple(stop),
        n=_number(body, "n", 1, s.max_n, 1, integer=True),
        seed=_number(body, "seed", 0, 2**63 - 1, None, integer=True))
