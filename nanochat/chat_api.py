"""The chat API's request side: server limits (`ServerSettings`), OpenAI-shaped errors
(`ApiError`) and parsing/validation of a chat-completions body into a `ChatRequest`, all before any
model work. Split out of server.py, which owns the app, the replica pool and generation;
nanochat/http_guard.py owns the HTTP-level checks (Host, Content-Type, body size).

Compatibility choices: messages may come in any order, and system / developer messages alone are
answered as the user's turn (normalised, see `_normalise`); fields whose effect this server cannot
honour (logprobs, tools, non-text response_format, logit_bias, audio output, web search, moderation,
non-zero penalties) are refused with 400 "unsupported_parameter", and
fields it does not know with "unknown_parameter", rather than silently ignored; those without
effect (`user`, `metadata`, ...) are checked for OpenAI's types ("invalid_type"); any `model` name
is accepted (a local server has one model; responses report the served name). Assistant history
comes back as the text the server streamed; its calculator calls ("<<expr=result>>") are rendered
as the tool tokens the model generated (`prompt_messages`). Messages: content is a string or text
parts (an assistant's refusal counts as its text); image/audio/file parts and tool-call history are
refused by index; `name` is accepted while each role has one speaker (the chat format has no names,
so two named users would merge into one voice: refused).
"""

import ipaddress
import json
import re
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from nanochat.calculator import tool_output, use_calculator

ROLES = ("system", "user", "assistant")
# A calculator call as the server streams it (nanochat.engine.TOOL_TEXT): "<<expr=result>>"
_TOOL_CALL = re.compile(r"<<([^<>]*)>>")


# ------------------------------------------------------------------------------------ settings

# ServerSettings fields that scripts/chat_web.py does not expose as flags (every other limit is
# --NAME with dashes; default_max_tokens is --max-tokens)
_NOT_FLAGS = frozenset({"max_stop"})


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
    # None: max(4, the pool's number of workers) (create_app: default_per_client), so one client (the
    # chat page, a benchmark) can fill every generation slot and still queue a few requests.
    max_concurrent_per_client: int | None = None
    # None: http_guard.default_connections_per_client (at least 256); open connections one address
    # (loopback ones not counted) may hold: the cap on a client holding sockets without requests
    max_connections_per_client: int | None = None
    max_queue: int = 128                    # requests waiting for a replica before 503
    allowed_hosts: tuple[str, ...] | None = None   # Host header names answered (DNS rebinding); None: any
    cors_origins: tuple[str, ...] = ()      # browser origins allowed to call the API cross-site; (): none

    def validate(self) -> "ServerSettings":
        """Errors name chat_web's flags: default_max_tokens is --max-tokens, max_max_tokens --max-max-tokens."""
        for name, value in asdict(self).items():
            if name in ("model_name", "api_key", "default_temperature", "max_temperature", "default_top_k",
                        "allowed_hosts", "cors_origins") or value is None and name in ("max_concurrent_per_client",
                                                                                  "max_connections_per_client"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                # max_stop has no chat_web flag: named as the field, not as a flag no one can pass
                flag = f"ServerSettings.{name}" if name in _NOT_FLAGS else \
                    "--" + name.removeprefix("default_").replace("_", "-")
                raise ValueError(f"{flag}: got {value!r}; accepted: an integer >= 1")
        if not 0 <= self.max_temperature < float("inf"):   # NaN fails this too
            raise ValueError(f"--max-temperature: got {self.max_temperature}; accepted: a finite number >= 0")
        for flag, limit, value, high, low in (
                ("--temperature", "--max-temperature", self.default_temperature, self.max_temperature, 0),
                ("--top-k", "--max-top-k", self.default_top_k, self.max_top_k, 0),
                ("--max-tokens", "--max-max-tokens", self.default_max_tokens, self.max_max_tokens, 1)):
            if not low <= value <= high:   # either flag may be the one the user set
                off = "0 = off; " if flag == "--top-k" else ""
                raise ValueError(f"{flag}: got {value}; accepted: {low}..{high} ({off}the limit {limit})")
        if self.api_key is not None and len(self.api_key) < 8:
            raise ValueError("--api-key (or $NANOCHAT_API_KEY): got a key shorter than 8 characters; accepted: >= 8 "
                             "characters")
        if isinstance(self.allowed_hosts, str) or isinstance(self.cors_origins, str):
            raise ValueError("allowed_hosts / cors_origins: got a string; accepted: a tuple of strings")
        for host in self.allowed_hosts or ():
            if not isinstance(host, str) or not re.fullmatch(r"[\w.:\[\]-]+", host):
                raise ValueError(f"--allowed-host: got {host!r}; accepted: a host name or IP address "
                                 "(e.g. chat.example.com, 192.168.1.5)")
        for origin in self.cors_origins:
            if not isinstance(origin, str) or not re.fullmatch(r"https?://[\w.-]+(:\d+)?|https?://\[[\w:.]+\](:\d+)?",
                                                               origin):
                raise ValueError(f"--cors-origin: got {origin!r}; accepted: an exact origin scheme://host[:port] "
                                 "without a path, e.g. http://localhost:3000")
            try:
                sent = browser_origin(origin)
            except ValueError as e:   # a port past 65535, a malformed IPv6 address or IDN label
                raise ValueError(f"--cors-origin: got {origin!r} ({e}); accepted: an exact origin "
                                 "scheme://host[:port], e.g. http://localhost:3000") from None
            if sent != origin:   # CORS compares the Origin header exactly: this one would never match
                raise ValueError(f"--cors-origin: got {origin!r}, which no browser sends: it writes that origin as "
                                 f"{sent!r} (lowercase, no default port), and origins are compared exactly; "
                                 f"accepted: {sent}")
        return self

    def sampling(self) -> dict:
        """The defaults a request gets for what it leaves out, and the largest values it may ask for."""
        return {"defaults": {"temperature": self.default_temperature, "top_k": self.default_top_k,
                             "max_tokens": self.default_max_tokens},
                "limits": {"temperature": self.max_temperature, "top_k": self.max_top_k,
                           "max_tokens": self.max_max_tokens}}

    def public(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "api_key"} | {"auth": self.api_key is not None}


def browser_origin(origin: str) -> str:
    """`origin` (scheme://host[:port]) as a browser writes it in its Origin header, the form CORS
    and HostGuard compare exactly: scheme and host lowercase, an IPv6 address compressed, a
    non-ASCII name in punycode, no default port (http 80, https 443). ValueError for a port past
    65535 or a malformed address."""
    parts = urlsplit(origin)
    host, port = parts.hostname or "", parts.port   # (.port raises ValueError past 65535)
    if ":" in host:
        host = f"[{ipaddress.ip_address(host).compressed}]"
    elif not host.isascii():
        # Python's "idna" codec is IDNA 2003, which maps ß, ς and the joiners away (straße -> strasse);
        # browsers keep them (IDNA 2008 / UTS 46: xn--strae-oqa): no suggestion there beats a wrong one
        if set(host) & set("\u00df\u03c2\u200c\u200d"):
            raise ValueError("a host name with ß, ς or a zero-width joiner: give it in punycode (xn--...) "
                             "as the browser's Origin header shows it")
        host = host.encode("idna").decode("ascii")   # (UnicodeError is a ValueError)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return f"{parts.scheme}://{host}" + ("" if port is None or port == default else f":{port}")


def default_per_client(workers: int) -> int:
    """The per-client concurrency limit when none is set: every slot, and at least 4 (with one slot a
    second tab's request waits in the queue instead of getting a 429)."""
    return max(4, workers)


class ApiError(Exception):
    """An error returned to the client as {"error": {...}} with an HTTP status."""

    # OpenAI's types: every 4xx but 429 (401 and 404 included) is an "invalid_request_error".
    TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})   # extra response headers (e.g. a 405's Allow)

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": _encodable(self.message), "type": kind, "param": _encodable(self.param),
                          "code": self.code}}


def _encodable(text: str | None) -> str | None:
    """`text` with lone surrogates written as escapes ("\\udc00"): an error may echo a client's
    string (an unknown field's name as `param`), and JSON "\\udc00" parses to one, which cannot be
    encoded as UTF-8: the JSON error became a 500 UnicodeEncodeError."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_surrogate(text: str, field: str) -> str:
    """A lone UTF-16 surrogate (JSON "\\ud800" without its pair) is no character: the tokenizer
    would read it as U+FFFD (a prompt other than the one sent), and a stop string holding one can
    never match the model's UTF-8 text, so the reply would silently run on."""
    found = _LONE_SURROGATE.search(text)
    if found:
        raise ApiError(400, f"'{field}': holds a lone UTF-16 surrogate {found.group()!r} at character "
                            f"{found.start()}; accepted: valid Unicode text (send surrogate pairs whole)",
                       param=field, code="invalid_value")
    return text


@dataclass
class ChatRequest:
    """A validated request; messages normalised (`_normalise`) to {"role", "content": str}."""

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

def _number(body: dict, name: str, low: float, high: float, default, *, integer=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    wrong_type = not isinstance(value, kinds) or isinstance(value, bool)   # a string, true, 1.5 for an integer
    if wrong_type or not low <= value <= high:
        raise ApiError(400, f"'{name}': got {json.dumps(value)}; accepted: {'an integer' if integer else 'a number'} "
                            f"in [{low}, {high}]", param=name, code="invalid_type" if wrong_type else "invalid_value")
    return value


# The content parts read and the key holding each one's text. Others (image_url, input_audio, file)
# are refused by index and type: dropped, the reply would answer a question about a picture without it.
_PART_TYPES = {"text": "text", "refusal": "refusal"}


def _content_text(m: dict, role: str, i: int) -> str:
    """A message's text: `content` as a string, or OpenAI's list of parts: {"type": "text", "text"}
    and, in an assistant message, {"type": "refusal", "refusal"} (what the assistant said when it
    refused). An assistant message echoed from a response whose `content` is null and `refusal` a
    string (OpenAI's shape of a refusal) is that text. Any other part (image_url, input_audio,
    file) is refused by its index and type."""
    content, where = m.get("content"), f"messages[{i}].content"
    accepted = ('accepted: a string or a list of {"type": "text", "text": string} parts'
                + (' (or {"type": "refusal", "refusal": string})' if role == "assistant" else ""))
    if isinstance(content, str):
        return content
    if content is None and role == "assistant" and isinstance(m.get("refusal"), str):
        return m["refusal"]
    if not isinstance(content, list):   # null: as if left out (the project's rule for a null field)
        raise ApiError(400, f"'{where}': got {_kind(content)}; {accepted}", param=where,
                       code="missing_required_parameter" if content is None else "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _PART_TYPES.get(kind) if kind == "text" or (role == "assistant" and isinstance(kind, str)) else None
        if kind == "refusal" and key is None:   # OpenAI's too: only an assistant refuses
            raise ApiError(400, f"'{where}[{j}]': a part of type \"refusal\" in a {role} message; {accepted}",
                           param=f"{where}[{j}]", code="invalid_value")
        if key is None and isinstance(kind, str):
            raise ApiError(400, f"'{where}[{j}]': a part of type {json.dumps(kind)[:80]}, which this server cannot "
                                f"read (it reads text only); {accepted}", param=f"{where}[{j}]",
                           code="unsupported_value")
        if key is None or not isinstance(part.get(key), str):
            raise ApiError(400, f"'{where}[{j}]': got {json.dumps(part)[:120]}; {accepted}", param=f"{where}[{j}]",
                           code="invalid_value")
        texts.append(part[key])
    return "".join(texts)


def _kind(value) -> str:
    """A JSON value's type as an error message names it."""
    return "null" if value is None else {dict: "an object", list: "a list", bool: "a boolean", int: "an integer",
                                         float: "a number", str: "a string"}.get(type(value), type(value).__name__)


# Message fields this server cannot render as history: it calls no tools and speaks no audio, so a
# turn holding a call (or a reference to earlier audio) dropped to its text is not what happened
_UNRENDERABLE = {"tool_calls": "tool call", "function_call": "function call", "audio": "audio"}


def _check_message_fields(m: dict, role: str, i: int, speakers: dict) -> None:
    """`name` must be a string; messages of one role may carry one name between them (the chat
    format has no place for names, and merged turns of two named speakers would read as one
    speaker); `_UNRENDERABLE` fields must be null or empty."""
    for field, what in _UNRENDERABLE.items():
        if m.get(field) not in (None, []):
            raise ApiError(400, f"'messages[{i}].{field}': {what} history is not supported by this server (it "
                                f"calls no tools and has no audio); leave '{field}' out",
                           param=f"messages[{i}].{field}", code="unsupported_parameter")
    name = m.get("name")
    if name is None:
        return
    if not isinstance(name, str):
        raise ApiError(400, f"'messages[{i}].name': got {_kind(name)}; accepted: a string", param=f"messages[{i}].name",
                       code="invalid_type")
    first = speakers.setdefault(role, (name, i))
    if first[0] != name:
        raise ApiError(400, f"'messages[{i}].name': {json.dumps(name)[:80]} after {json.dumps(first[0])[:80]} "
                            f"(messages[{first[1]}]): this server cannot tell two participants of the role '{role}' "
                            "apart (its chat format has no names); accepted: one name per role",
                       param=f"messages[{i}].name", code="unsupported_value")


def _raw_messages(raw, s: ServerSettings) -> list[dict]:
    """Each message as {"role", "content": str}, in the client's order; the limits apply here, to
    what the client sent (normalising merges messages, so it would hide a too-long list)."""
    if not isinstance(raw, list) or not raw:   # (OpenAI's codes: null / left out, not a list, [])
        raise ApiError(400, "'messages': accepted: a non-empty list of {role, content}", param="messages",
                       code="missing_required_parameter" if raw is None else "empty_array" if raw == [] else
                       "invalid_type")
    if len(raw) > s.max_messages:
        raise ApiError(400, f"'messages': got {len(raw)} messages; the limit is {s.max_messages}",
                       param="messages", code="too_many_messages")
    out, total, speakers = [], 0, {}
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ApiError(400, f"'messages[{i}]': got {_kind(m)}; accepted: an object {{role, content}}",
                           param=f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ROLES:
            tools = role in ("tool", "function")   # OpenAI's roles, which this server cannot answer
            code = ("missing_required_parameter" if role is None else "invalid_type" if not isinstance(role, str)
                    else "unsupported_value" if tools else "invalid_value")
            raise ApiError(400, f"'messages[{i}].role': got {json.dumps(role)}; accepted: system|developer|user|"
                                f"assistant{' (tool results: this server calls no tools)' if tools else ''}",
                           param=f"messages[{i}].role", code=code)
        _check_message_fields(m, role, i, speakers)
        text = _no_surrogate(_content_text(m, role, i), f"messages[{i}].content")
        if len(text) > s.max_message_chars:
            raise ApiError(400, f"'messages[{i}].content': {len(text)} characters; the limit is "
                                f"{s.max_message_chars}", param=f"messages[{i}].content", code="message_too_long")
        total += len(text)
        out.append({"role": role, "content": text})
    if total > s.max_total_chars:
        raise ApiError(400, f"'messages': {total} characters in total; the limit is {s.max_total_chars}",
                       param="messages", code="messages_too_long")
    return out


def _normalise(messages: list[dict]) -> list[dict]:
    """OpenAI accepts messages in any order, but the model was trained on one leading system
    message and then user/assistant turns alternating from the user. So: every system message
    (wherever it is) joins one leading system message, consecutive same-role turns merge, and a
    conversation opening with the assistant (a chat UI's greeting) gets an empty user turn first.
    Empty system messages (what some clients send for "none") are dropped and an empty turn merged
    into its neighbour adds nothing: joined, they left blank lines before the real text.

    Only system / developer messages (an instruction-only prompt: "Summarise X in one line."): OpenAI
    answers it, and so does this server: the text becomes the user turn, exactly the prompt the model
    sees for that system text over an empty user message (the tokenizer folds a system message into
    the first user turn, as SFT trained it). Refused before, as "no user message"."""
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    turns: list[dict] = []
    for m in messages:
        if m["role"] == "system":
            continue
        if turns and turns[-1]["role"] == m["role"]:   # (an empty one adds no blank lines either)
            turns[-1]["content"] = "\n\n".join(t for t in (turns[-1]["content"], m["content"]) if t)
        else:
            turns.append(dict(m))
    if not turns:   # system / developer messages alone: their text is what the user asks
        return [{"role": "user", "content": "\n\n".join(system)}]
    if not any(m["role"] == "user" for m in turns):
        raise ApiError(400, "'messages': no user message; accepted: a conversation with at least one "
                            "message of role 'user'", param="messages", code="missing_required_parameter")
    if turns[-1]["role"] != "user":
        raise ApiError(400, f"'messages': the last message is from the {turns[-1]['role']}; accepted: a "
                            "conversation whose last message is from the user (the reply answers it)",
                       param="messages", code="invalid_value")
    if turns[0]["role"] == "assistant":
        turns.insert(0, {"role": "user", "content": ""})
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + turns


def tool_call_parts(text: str) -> str | list[dict]:
    """An assistant message as this server streamed it -> the content the model generated.

    The stream shows a calculator call `<|python_start|>expr<|python_end|><|output_start|>result
    <|output_end|>` as "<<expr=result>>" (TOOL_TEXT); a client sends that text back as history,
    and rendered as plain text it is not what the model wrote nor what SFT trained on (GSM8K calls
    are python / python_output parts). So every "<<expr=result>>" whose result is exactly what
    the engine's calculator forces for expr becomes those parts again, "<<expr=error>>" for an
    expr the calculator refuses included (calculator.tool_output; "<<expr=>>", what the engine
    forced there before, too); anything else (a
    cut-off call, a wrong result, text that only looks like one) stays text. Returns `text`
    unchanged when it holds no such call."""
    parts, pos = [], 0
    for m in _TOOL_CALL.finditer(text):
        expr, eq, result = m.group(1).rpartition("=")
        # a refused call's "" too: what the engine forced before REFUSED_OUTPUT (older transcripts)
        if not eq or (result != tool_output(expr) and (result or use_calculator(expr) is not None)):
            continue
        if m.start() > pos:
            parts.append({"type": "text", "text": text[pos:m.start()]})
        parts += [{"type": "python", "text": expr}, {"type": "python_output", "text": result}]
        pos = m.end()
    if not parts:
        return text
    if pos < len(text):
        parts.append({"type": "text", "text": text[pos:]})
    return parts


def prompt_messages(messages: list[dict]) -> list[dict]:
    """A ChatRequest's messages for Tokenizer.render_for_completion: assistant turns with their
    calculator calls as tool parts (`tool_call_parts`), the rest as they are."""
    return [{**m, "content": tool_call_parts(m["content"])} if m["role"] == "assistant" else m for m in messages]


# Every top-level field a request may carry. Read by parse_chat_request (top_k is this server's
# extension: the sampler's top-k, 0 = off):
_FIELDS_USED = frozenset({"messages", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                          "stop", "temperature", "top_p", "top_k", "n", "seed", "presence_penalty",
                          "frequency_penalty"})
# refused when they ask for something (_refuse_unsupported):
_FIELDS_REFUSED = frozenset({"logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
                             "response_format", "logit_bias", "modalities", "audio", "web_search_options",
                             "moderation"})
# OpenAI's that do not change what the answer says (bookkeeping, caching, latency and reasoning hints):
# accepted, no effect.
_FIELDS_WITHOUT_EFFECT = frozenset({"user", "metadata", "store", "parallel_tool_calls", "service_tier", "prediction",
                                    "reasoning_effort", "verbosity", "safety_identifier", "prompt_cache_key",
                                    "prompt_cache_retention", "prompt_cache_options"})
FIELDS = _FIELDS_USED | _FIELDS_REFUSED | _FIELDS_WITHOUT_EFFECT
# Their types, as OpenAI checks them: without effect here, a wrong one is still the client's bug
# ("user": 5 is an id that a log joins on nothing; "store": "false" is a truthy string).
_EFFECTLESS_TYPES = {"user": str, "metadata": dict, "store": bool, "parallel_tool_calls": bool, "service_tier": str,
                     "prediction": dict, "reasoning_effort": str, "verbosity": str, "safety_identifier": str,
                     "prompt_cache_key": str, "prompt_cache_retention": str, "prompt_cache_options": dict}
_TYPE_WORDS = {str: "a string", dict: "an object", bool: "true|false"}


def _refuse_unknown(body: dict) -> None:
    """A field this server does not know would be ignored: a typo ("max_token": 5 would give the
    default length) or another server's sampling extension (repetition_penalty, min_p) changes
    nothing, silently. OpenAI refuses unrecognized arguments too; a null one asks for nothing."""
    for name, value in body.items():
        if name not in FIELDS and value is not None:
            raise ApiError(400, f"{name!r}: not a parameter this server knows (misspelt, or another server's "
                                f"extension?); leave it out. Accepted: {', '.join(sorted(FIELDS))}",
                           param=name, code="unknown_parameter")


def _check_effectless_types(body: dict) -> None:
    """`_FIELDS_WITHOUT_EFFECT` change nothing, but one of the wrong type (null aside) is a 400
    naming it, as OpenAI answers it: accepted unread, the client's bug went unreported.
    `metadata` is OpenAI's map of strings to strings."""
    for name, kind in _EFFECTLESS_TYPES.items():
        value = body.get(name)
        if value is None:
            continue
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if name == "metadata":
            ok = ok and all(isinstance(v, str) for v in value.values())
        if not ok:
            want = "an object of string values" if name == "metadata" else _TYPE_WORDS[kind]
            got = json.dumps(value)[:120] if isinstance(value, dict) else _kind(value)
            raise ApiError(400, f"{name!r}: got {got}; "
                                f"accepted: {want} (it has no effect on the answer), null, or leave {name!r} out",
                           param=name, code="invalid_type")


def _refuse_unsupported(body: dict) -> None:
    """Fields whose effect this server cannot produce: ignoring them would hand the client an
    answer that means something else (no log-probabilities, no tool call, no JSON guarantee, a
    token the client banned, no audio, no search). Each refusal names the field and the values
    that are accepted (those asking for nothing this server lacks)."""
    def refuse(name: str, what: str, accepted: str):
        raise ApiError(400, f"'{name}': {what} is not supported by this server; accepted: {accepted}, or leave "
                            f"'{name}' out", param=name, code="unsupported_parameter")
    if body.get("logprobs") not in (None, False):
        refuse("logprobs", "returning log-probabilities", "false or null")
    if body.get("top_logprobs") is not None:
        refuse("top_logprobs", "returning log-probabilities", "null")
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools not in (None, []) and choice != "none":
        refuse("tools", "calling tools", '[] or null, or tools with tool_choice "none" (then never called)')
    if not tools and choice not in (None, "none", "auto"):
        refuse("tool_choice", "forcing a tool call", '"none", "auto" (no tool is ever called) or null')
    functions, call = body.get("functions"), body.get("function_call")   # the deprecated tools/tool_choice
    if functions not in (None, []) and call != "none":
        refuse("functions", "calling functions", '[] or null, or functions with function_call "none"')
    if not functions and call not in (None, "none", "auto"):
        refuse("function_call", "forcing a function call", '"none", "auto" or null')
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        refuse("response_format", "a response format other than plain text", '{"type": "text"} or null')
    if body.get("logit_bias") not in (None, {}):   # e.g. {id: -100} bans a token; ignoring that is not harmless
        refuse("logit_bias", "biasing token probabilities", "{} or null")
    if body.get("modalities") not in (None, ["text"]):
        refuse("modalities", "an output other than text", '["text"] or null')
    if body.get("audio") is not None:
        refuse("audio", "audio output", "null")
    if body.get("web_search_options") is not None:
        refuse("web_search_options", "searching the web", "null")
    if body.get("moderation") is not None:   # "block" would withhold a flagged answer, "score" add scores to it
        refuse("moderation", "moderating the input and output", "null")
    for name in ("presence_penalty", "frequency_penalty"):   # 0 (OpenAI's default) is what the sampler does
        if _number(body, name, -2, 2, 0) != 0:
            raise ApiError(400, f"'{name}': got {json.dumps(body[name])}; penalising repeated tokens is not "
                                f"supported by this server; accepted: 0 or leave '{name}' out",
                           param=name, code="unsupported_parameter")


def _stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage). `stream` is nullable (null = false), as in OpenAI's spec."""
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream': accepted: true|false|null", param="stream", code="invalid_type")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise ApiError(400, "'stream_options': only allowed when 'stream' is true; accepted: null when not "
                            "streaming, or leave 'stream_options' out", param="stream_options", code="invalid_value")
    # include_obfuscation: OpenAI's random padding of deltas, which this server never adds; any other
    # key (a typo like "include_usag") would silently drop what the client asked for
    known = ("include_usage", "include_obfuscation")
    code = ("invalid_type" if not isinstance(opts, dict) else "unknown_parameter" if set(opts) - set(known) else
            "invalid_type" if any(opts.get(k) not in (None, True, False) for k in known) else None)
    if code:   # param stays the object's name (the message shows the whole object)
        raise ApiError(400, f"'stream_options': got {json.dumps(opts)[:200]}; accepted: {{\"include_usage\": "
                            "true|false, \"include_obfuscation\": true|false}", param="stream_options", code=code)
    return stream, bool(opts.get("include_usage"))


def _stop_strings(stop, limit: int) -> list[str]:
    """`stop`: null, a string or a list of up to `limit` strings of 1..100 characters. {} / 0 /
    false are client bugs, not "none"; an empty string would never match (TextStream skips it), so
    the client's stop would silently do nothing. The error says which rule the value broke."""
    lone = isinstance(stop, str)   # a lone string is `stop`, not an item of a list (`stop[i]`, as messages[i])
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    accepted = f"accepted: a string or a list of up to {limit} non-empty strings of <= 100 characters"
    code = "invalid_value"   # a count or length out of bounds; a value of the wrong JSON type: invalid_type
    if not isinstance(stop, list):
        problem, code = f"got {_kind(stop)}", "invalid_type"
    elif len(stop) > limit:
        problem = f"got {len(stop)} strings, more than {limit}"
    else:
        bad = next(((j, x) for j, x in enumerate(stop) if not isinstance(x, str) or not 0 < len(x) <= 100), None)
        if bad is None:
            return [_no_surrogate(x, "stop" if lone else f"stop[{j}]") for j, x in enumerate(stop)]
        j, x = bad
        what = (_kind(x) if not isinstance(x, str) else
                "an empty string" if not x else f"a string of {len(x)} characters")
        code = code if isinstance(x, str) else "invalid_type"
        param = "stop" if lone else f"stop[{j}]"
        raise ApiError(400, f"'{param}': got {what}; {accepted}", param=param, code=code)
    raise ApiError(400, f"'stop': {problem}; {accepted}", param="stop", code=code)


def parse_chat_request(body, s: ServerSettings) -> ChatRequest:
    """Validate a /v1/chat/completions body against the limits; ApiError(400) names the field.

    Accepted, without effect on the answer: `_FIELDS_WITHOUT_EFFECT` (`user`, `metadata`, `store`,
    `prediction` (a latency hint), `reasoning_effort`, ...) when of OpenAI's type (else
    invalid_type: `_check_effectless_types`), and a null unknown field. Refused
    (unsupported_parameter): see `_refuse_unsupported`, including a non-zero `presence_penalty` /
    `frequency_penalty` (the sampler has no penalties); any other field: unknown_parameter.
    `top_p: 0` means greedy decoding; a negative `seed` maps into the engine's range (seed % 2**64: one-to-one over int64, non-negative seeds unchanged).
    Message contents and stop strings holding a lone UTF-16 surrogate are refused (`_no_surrogate`).
    Every 400 carries OpenAI's `code`: invalid_type (a wrong JSON type), invalid_value,
    missing_required_parameter (a required field null or left out, or no user message), empty_array,
    unknown_/unsupported_parameter, unsupported_value, or a limit's own code (too_many_messages, ...)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body: accepted: a JSON object", code="invalid_type")   # no field to name
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model': accepted: a string", param="model", code="invalid_type")
    _refuse_unknown(body)
    _check_effectless_types(body)
    messages = _normalise(_raw_messages(body.get("messages"), s))
    _refuse_unsupported(body)
    stream, include_usage = _stream_flags(body)
    # max_completion_tokens replaced max_tokens in OpenAI's API and wins; a null one defers to
    # max_tokens. Both are checked: a bad max_tokens next to a good max_completion_tokens was
    # accepted unread, the client's bug unreported.
    legacy = _number(body, "max_tokens", 1, s.max_max_tokens, None, integer=True)
    max_tokens = _number(body, "max_completion_tokens", 1, s.max_max_tokens, legacy, integer=True)
    stop = _stop_strings(body.get("stop"), s.max_stop)
    temperature = float(_number(body, "temperature", 0, s.max_temperature, s.default_temperature))
    top_p = _number(body, "top_p", 0, 1, None)
    from nanochat.sampling import greedy_if_top_p_zero   # torch: loaded by the server already
    temperature, top_p = greedy_if_top_p_zero(temperature, top_p)
    seed = _number(body, "seed", -2**63, 2**63 - 1, None, integer=True)  # OpenAI's seed is any int64
    return ChatRequest(
        messages=messages, stream=stream, include_usage=include_usage, temperature=temperature,
        top_k=_number(body, "top_k", 0, s.max_top_k, s.default_top_k, integer=True) or None,
        top_p=top_p, max_tokens=max_tokens, stop=tuple(stop), n=_number(body, "n", 1, s.max_n, 1, integer=True),
        seed=None if seed is None else seed % 2**64)
