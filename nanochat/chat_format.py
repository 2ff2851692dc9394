"""The chat conversation format the tokenizer renders: a conversation's contract and its
assistant content parts. `check_conversation` says whether `Tokenizer.render_conversation` would
accept a conversation (no tokenizer needed, so conversation files are checked when a task is
built); `assistant_parts` turns generated ids back into an assistant message's content parts.

A conversation is {"messages": [...]}: an optional system message first (folded into the first
user message), then user / assistant turns alternating, starting with the user. User content is a
str; assistant content is a str or a list of {"type": text|python|python_output, "text": str}.
nanochat/tokenizer.py renders it with loss masks and re-exports every name here.
"""

from __future__ import annotations

from typing import Sequence


def _normalized_messages(conversation: dict) -> list[tuple[int, str, object]]:
    """Validate a conversation; return (original index, role, content) with the system
    message folded into the first user message and roles alternating user/assistant."""
    if not isinstance(conversation, dict):
        raise ValueError(f"conversation: got {type(conversation).__name__}; accepted: a dict with a "
                         "'messages' list")
    messages = conversation.get("messages")
    if not isinstance(messages, list):
        raise ValueError(f"conversation['messages']: got {type(messages).__name__}; accepted: a list of "
                         "{'role', 'content'} dicts")
    if not messages:
        raise ValueError("conversation['messages']: got an empty list; accepted: at least one user message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):  # not reported as a bad role: the message itself is wrong
            raise ValueError(f"messages[{i}]: got {type(m).__name__} {m!r:.60}; accepted: a dict with "
                             "'role' and 'content'")
        if m.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{i}].role: got {m.get('role')!r}; accepted: system|user|assistant")
    out = [(i, m["role"], m.get("content")) for i, m in enumerate(messages)]
    if out[0][1] == "system":
        if len(out) < 2:  # there is no messages[1] to blame
            raise ValueError("messages: got only a system message; accepted: a user message after it")
        if out[1][1] != "user":
            raise ValueError("messages[1].role: a system message must be followed by a user message")
        system, user = out[0][2], out[1][2]
        for idx, content in ((0, system), (1, user)):
            if not isinstance(content, str):
                raise ValueError(f"messages[{idx}].content: got {type(content).__name__}; accepted: str")
        # an empty user turn (the API puts one before a chat that opens with the assistant's
        # greeting) leaves the system text alone, not followed by a dangling blank line; an empty
        # system message (what some clients send for "none") leaves the user text alone
        out = [(1, "user", "\n\n".join(t for t in (system, user) if t))] + out[2:]
    for k, (i, role, content) in enumerate(out):
        expected = "user" if k % 2 == 0 else "assistant"
        if role != expected:
            raise ValueError(f"messages[{i}].role: got {role!r}; expected {expected!r} "
                             "(roles must alternate user/assistant, starting with user; "
                             "system only first)")
        if role == "user" and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: got {type(content).__name__}; accepted: str")
    return out


def _assistant_parts(i: int, content) -> list[tuple[str, str]]:
    if isinstance(content, str):
        return [("text", content)]
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content: got {type(content).__name__}; accepted: str or "
                         "a list of {'type': text|python|python_output, 'text': str}")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "python", "python_output") or not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content[{j}]: got {part!r}; accepted: "
                             "{'type': text|python|python_output, 'text': str}")
        parts.append((kind, part["text"]))
    return parts


def check_conversation(conversation: dict) -> None:
    """ValueError naming the message (its index in the file's list) unless render_conversation
    would accept `conversation`. Needs no tokenizer, so conversation files are checked with it when
    a task is built, not when the loader first renders a bad row hours into training."""
    for i, role, content in _normalized_messages(conversation):
        if role == "assistant":
            _assistant_parts(i, content)


def assistant_parts(tokenizer, ids: Sequence[int]) -> list[dict]:
    """Generated ids (without the stop token) -> an assistant message's content parts
    [{"type": "text"|"python"|"python_output", "text": ...}], so a conversation can be rendered
    again with its tool calls intact (the CLI keeps history this way; nanochat.engine re-exports it).
    Other special tokens the model wrote (<|user_end|>, <|assistant_start|>) are dropped, as a
    stream shows them (nanochat/text_stream.py): decoded, they were their names as text, which the
    next turn then rendered as ordinary tokens that the user never saw."""
    kinds = {tokenizer.encode_special("<|python_start|>"): "python",
             tokenizer.encode_special("<|output_start|>"): "python_output"}
    ends = {tokenizer.encode_special("<|python_end|>"), tokenizer.encode_special("<|output_end|>")}
    others = {tokenizer.encode_special(name) for name in getattr(tokenizer, "special_tokens", ())}
    others -= set(kinds) | ends
    parts, kind, buf = [], "text", []

    def flush(closed: bool = False):
        # a closed tool block is kept even when empty (a refused call's output, an empty call):
        # dropped, the next render would lose its start / end tokens
        if buf or (closed and kind != "text"):
            parts.append({"type": kind, "text": tokenizer.decode(buf)})
            buf.clear()
    for t in ids:
        if t in kinds:
            flush()
            kind = kinds[t]
        elif t in ends:
            flush(closed=True)
            kind = "text"
        elif t in others:
            continue
        else:
            buf.append(t)
    flush()
    return parts
