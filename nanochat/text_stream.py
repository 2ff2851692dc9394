"""TextStream: token ids -> the text deltas a streaming client shows (incremental UTF-8, special
tokens rendered, stop strings cut with their possible prefixes held back). Used by chat_cli and
the server; the engine produces the ids."""
from __future__ import annotations

import codecs
from typing import Sequence


class TextStream:
    """Token ids -> text deltas for streaming display.

    Decodes the tokens' bytes incrementally, so a character split across tokens (or across
    several, as in large byte-level BPE vocabularies) appears once it is complete and never as
    U+FFFD; bytes that cannot become UTF-8 show as U+FFFD as soon as that is known. Renders special
    tokens through `special_text` (unlisted specials show as nothing), and, given `stop_strings`,
    cuts the text at the first stop string, holding back any tail that could still become one.
    `feed` returns the new text; `finish` flushes the rest.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), special_text: dict[int, str] | None = None):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.special_text = special_text or {}
        self._specials = {tokenizer.encode_special(name) for name in tokenizer.special_tokens} \
            if hasattr(tokenizer, "special_tokens") else set(self.special_text)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""        # everything decoded so far (cut at a stop string)
        self.emitted = 0      # how many characters of self.text were returned
        self.stopped = False  # a stop string was found

    def _flush(self) -> str:
        """What an incomplete character held back so far comes to (U+FFFD) before a special token
        or the end."""
        return self._utf8.decode(b"", final=True)

    def feed(self, token: int) -> str:
        if self.stopped:
            return ""
        if token in self._specials:
            self.text += self._flush() + self.special_text.get(token, "")
        else:
            self.text += self._utf8.decode(self.tokenizer.decode_bytes([token]))
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self.text += self._flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop_strings and not self.stopped:
            longest = max(len(s) for s in self.stop_strings)
            start = max(0, self.emitted - longest + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
        end = len(self.text)
        if self.stop_strings and not self.stopped and not final:
            end -= self._held_tail()
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def _held_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        for n in range(min(max(len(s) for s in self.stop_strings) - 1, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return n
        return 0
