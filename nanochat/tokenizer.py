"""The BPE tokenizer: training (through the Rust `rustbpe` module), encoding and decoding (through
tiktoken), special tokens, chat rendering with loss masks, and the on-disk format. The conversation
format it renders (`check_conversation`: its contract, checked without a tokenizer;
`assistant_parts`: generated ids back into a message's content parts) lives in
nanochat/chat_format.py and is re-exported here; the split pattern (SPLIT_PATTERN, also re-exported) and
the checks every pattern passes before tiktoken uses it live in nanochat/tokenizer_pattern.py.

On disk a tokenizer is a directory holding
  tokenizer.pkl    {"format_version", "pattern", "mergeable_ranks" (bytes -> rank),
                    "special_tokens" (names, in id order after the merges), "fingerprint"}
  token_bytes.pt   int32 tensor (vocab_size,): UTF-8 byte length of each token, 0 for special
                   tokens (bits-per-byte evaluation divides summed loss by summed bytes)
Both are written to temp files first, then put in place with os.replace (their directory is then
fsynced, so the new pair survives a power cut); a failed save leaves the previous pair intact. The
pickle is read with an unpickler that refuses every global, so a tampered file cannot run code; it
holds only builtin types.

Ids: 0..255 are the raw bytes, then the merges in rank order, then SPECIAL_TOKENS in list order.
Plain text never produces a special token: "<|bos|>" typed by a user encodes as ordinary bytes.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import operator
import pickle
import re
import reprlib
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import tiktoken

from nanochat.chat_format import (  # noqa: F401  (re-exported: tasks, engine and tests import them from here)
    _assistant_parts, _normalized_messages, assistant_parts, check_conversation)
from nanochat.errors import RequestError
from nanochat.tokenizer_io import _SafeUnpickler, _atomic_write_all, _check_pickle_bounds
from nanochat.tokenizer_pattern import (  # SPLIT_PATTERN and DroppedTextWarning re-exported
    SPLIT_PATTERN, DroppedTextWarning, _check_pattern, _rustbpe, warn_dropped_text)  # noqa: F401  (DroppedTextWarning)

if TYPE_CHECKING:  # torch is imported lazily: importing this module must stay cheap
    import torch

SPECIAL_TOKENS = [
    "<|bos|>",  # starts every document; the dataloader packs documents on it
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",  # the assistant calls the calculator / python tool
    "<|python_end|>",
    "<|output_start|>",  # the tool's output, forced in by the engine: mask 0 (mid_train's mask=all trains it)
    "<|output_end|>",
]

FORMAT_VERSION = 1
PICKLE_NAME = "tokenizer.pkl"
TOKEN_BYTES_NAME = "token_bytes.pt"
MAX_VOCAB_SIZE = 2**32  # ids must fit in uint32 (tiktoken's Rank type)
MAX_TRAIN_THREADS = 1024  # rustbpe's limit: beyond it thread start-up dominates (a typo, not a setting)
MAX_TRAIN_BATCH_SIZE = 2**63 - 1  # rustbpe reads the batch size as a signed 64-bit int
# tiktoken's split regex (`\s+(?!\S)`) runs out of backtracking room on a whitespace run of ~1M
# characters and panics (pyo3's PanicException, a BaseException that `except Exception` misses;
# seen with tiktoken 0.14 at 999,999 spaces). Longer runs are encoded, and trained on, in pieces of this many
# characters: the bytes are the same, only the run's tokens change at the cuts.
MAX_WHITESPACE_RUN = 100_000
# (?<!\s): a run is tried only from its first character. Bare \s{N,} was tried again at every
# position of a shorter run, quadratic in its length (a 99,999-space run: ~12 s to encode).
_LONG_WHITESPACE = re.compile(r"(?<!\s)\s{%d,}" % MAX_WHITESPACE_RUN)
_NO_DOCUMENT = object()  # sentinel: a None item is a bad document, not the end
_REPR = reprlib.Repr()   # containers shown to depth 3, strings and others to 60 characters
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60
_HOW_TO_CREATE = "create it with `python -m scripts.tok_train` (or pass the right directory)"


class TokenizerError(RequestError):
    """A tokenizer on disk is missing, corrupt or incompatible; the message names the path (and
    how to create one): a RequestError, so the scripts print it as one line."""

    def __init__(self, path: str | Path, problem: str):
        self.path = Path(path)
        super().__init__(f"tokenizer at {self.path}: {problem}; {_HOW_TO_CREATE}")


class VocabTooLargeError(ValueError):
    """Tokenizer.train: the text runs out of pairs to merge before `vocab_size`; `supported` is the
    largest vocab_size it gives (callers with flags, e.g. tok_train, name their own)."""

    def __init__(self, message: str, supported: int):
        super().__init__(message)
        self.supported = supported


def _short_repr(value, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters without building the whole repr: that of a 300 MB bytes
    item took seconds and a GB, and that of a deeply nested list (an edited tokenizer.pkl) raised
    RecursionError instead of the error it was for."""
    if isinstance(value, (str, bytes, bytearray)):
        value = value[:limit + 1]
    try:
        return _REPR.repr(value)[:limit]
    except Exception:   # a __repr__ that raises, an int of 4,300+ digits: the type still says what it was
        return f"<{type(value).__name__}>"


def _shown(value) -> str:  # with its type unless an int: 300.0, True and "8" print like accepted values
    return _short_repr(value) if type(value) is int else f"{_short_repr(value)} ({type(value).__name__})"


def _int_in(value, name: str, lo: int, hi: int | None, accepted: str | None = None) -> int:
    """`value` as an int in lo..hi (hi None: unbounded), else ValueError naming `name`. numpy and
    torch integers count (operator.index, as in decode: an id read from an array); bools do not."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < lo or (hi is not None and n > hi):
        raise ValueError(f"{name}: got {_shown(value)}; accepted: {accepted or f'{lo}..{hi}'}")
    return n


def _encodable_name(name) -> bool:
    """A special token's name: a non-empty str that UTF-8 can encode (no lone surrogates)."""
    if not isinstance(name, str) or not name:
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _positive_int(value, name: str) -> int:
    return _int_in(value, name, 1, None, "a positive integer")


def _fingerprint_of(payload: dict) -> str | None:
    """A saved record's fingerprint recomputed from its fields; None if they are not of the right types."""
    try:
        return _compute_fingerprint(payload["pattern"], payload["mergeable_ranks"], payload["special_tokens"])
    except (KeyError, TypeError, AttributeError, UnicodeEncodeError):
        return None


def _compute_fingerprint(pattern: str, ranks: dict[bytes, int], specials: Sequence[str]) -> str:
    # Length-prefixed fields in rank order, so no two different tokenizers serialize alike.
    h = hashlib.sha256(b"nanochat-tokenizer\0")
    for field in (pattern.encode("utf-8"), *sorted(ranks, key=ranks.__getitem__)):
        h.update(len(field).to_bytes(8, "little"))
        h.update(field)
    h.update(b"\0specials\0")
    for name in specials:
        raw = name.encode("utf-8")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def _check_ranks(ranks: dict[bytes, int]) -> None:
    """ValueError unless ranks are 0..n-1 with the 256 single bytes first (tiktoken's assumption)."""
    if not isinstance(ranks, dict) or len(ranks) < 256:
        raise ValueError("mergeable ranks: expected a dict of at least the 256 byte tokens")
    # types first: sorting other values compared them (lists of lists: RecursionError), and bools
    # passed as ranks 0 and 1
    bad = next(((k, v) for k, v in ranks.items()
                if not isinstance(k, bytes) or isinstance(v, bool) or not isinstance(v, int)), None)
    if bad is not None:
        raise ValueError(f"mergeable ranks: got {_shown(bad[0])} -> {_shown(bad[1])}; accepted: bytes -> int")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("mergeable ranks: ranks are not exactly 0..n-1")
    for b in range(256):
        if ranks.get(bytes([b])) != b:
            raise ValueError(f"mergeable ranks: byte {b} does not have rank {b}")


def whitespace_pieces(text: str) -> list[str]:
    """`text` cut inside whitespace runs longer than MAX_WHITESPACE_RUN, every MAX_WHITESPACE_RUN
    characters of the run; the pieces are encoded (and trained on) separately."""
    if len(text) < MAX_WHITESPACE_RUN:   # the common case costs one length check
        return [text]
    pieces, start = [], 0
    for run in _LONG_WHITESPACE.finditer(text):
        for cut in range(run.start() + MAX_WHITESPACE_RUN, run.end(), MAX_WHITESPACE_RUN):
            pieces.append(text[start:cut])
            start = cut
    return pieces + [text[start:]]


def encode_ordinary(enc: tiktoken.Encoding, text: str) -> list[int]:
    """enc.encode_ordinary(text), with whitespace runs longer than MAX_WHITESPACE_RUN cut."""
    pieces = whitespace_pieces(text)
    return enc.encode_ordinary(text) if len(pieces) == 1 else [i for p in pieces for i in enc.encode_ordinary(p)]


def encode_ordinary_batch(enc: tiktoken.Encoding, texts: Sequence[str], num_threads: int) -> list[list[int]]:
    """enc.encode_ordinary_batch in threads; the few texts with a long whitespace run go through
    encode_ordinary instead."""
    long_runs = {i for i, t in enumerate(texts) if len(t) >= MAX_WHITESPACE_RUN and _LONG_WHITESPACE.search(t)}
    rows = enc.encode_ordinary_batch(["" if i in long_runs else t for i, t in enumerate(texts)],
                                     num_threads=num_threads)
    for i in long_runs:
        rows[i] = encode_ordinary(enc, texts[i])
    return rows


class Tokenizer:
    """A trained byte-level BPE with the chat special tokens appended after the merges."""

    def __init__(self, pattern: str, mergeable_ranks: dict[bytes, int],
                 special_tokens: Sequence[str] = tuple(SPECIAL_TOKENS)):
        self._setup(pattern, mergeable_ranks, special_tokens, existing=False)

    @classmethod
    def _existing(cls, pattern, mergeable_ranks, special_tokens) -> "Tokenizer":
        """A tokenizer that already exists (a file, a pickled one): a pattern that leaves characters
        unmatched is kept (self._drops: the first one), not refused; see nanochat/tokenizer_pattern.py."""
        tok = cls.__new__(cls)
        tok._setup(pattern, mergeable_ranks, special_tokens, existing=True)
        return tok

    def _setup(self, pattern, mergeable_ranks, special_tokens, *, existing: bool) -> None:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("pattern: expected a non-empty regex string")
        # before tiktoken compiles it (its errors named no argument)
        self._drops: str | None = _check_pattern(pattern, existing=existing)
        _check_ranks(mergeable_ranks)
        specials = list(special_tokens)
        bad = next((k for k, name in enumerate(specials) if not _encodable_name(name)), None)
        if bad is not None:  # tiktoken's TypeError / UnicodeEncodeError named no argument; "" decodes as nothing
            raise ValueError(f"special_tokens[{bad}]: got {_shown(specials[bad])}; accepted: a non-empty str "
                             "without lone surrogates")
        if len(set(specials)) != len(specials) or not set(SPECIAL_TOKENS) <= set(specials):
            raise ValueError(f"special_tokens: must be unique and include all of {SPECIAL_TOKENS}")
        n = len(mergeable_ranks)
        self._pattern = pattern
        self._ranks = dict(mergeable_ranks)
        self._specials = specials
        self._special_ids = {name: n + i for i, name in enumerate(specials)}
        self._enc = tiktoken.Encoding(
            name="nanochat", pat_str=pattern, mergeable_ranks=self._ranks,
            special_tokens=self._special_ids, explicit_n_vocab=n + len(specials),
        )
        self._fingerprint = _compute_fingerprint(pattern, self._ranks, specials)

    # Rebuild the tiktoken object after unpickling (e.g. in DataLoader worker processes).
    def __getstate__(self):
        return {"pattern": self._pattern, "ranks": self._ranks, "specials": self._specials}

    def __setstate__(self, state):
        # the copy of a loaded tokenizer (a DataLoader or Pool worker): its pattern is not new, and the
        # process that loaded it has warned if it drops text
        self._setup(state["pattern"], state["ranks"], state["specials"], existing=True)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, fingerprint={self.fingerprint[:12]})"

    # ------------------------------------------------------------------ training

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, pattern: str = SPLIT_PATTERN,
              threads: int | None = None, batch_size: int = 8192) -> "Tokenizer":
        """Train on `texts` (streamed; never held in memory at once). `vocab_size` counts the 256
        byte tokens, the merges and the special tokens. `threads`: 1..MAX_TRAIN_THREADS rustbpe
        workers (None: RAYON_NUM_THREADS, else all cores). `pattern` must be a regex whose matches
        cover all text and can never be empty (checked first: tiktoken drops unmatched text, and
        panics on an empty match)."""
        vocab_size = _int_in(vocab_size, "vocab_size", 256 + len(SPECIAL_TOKENS), MAX_VOCAB_SIZE)
        # bounded here: beyond it rustbpe refused it under its own name, after the first text was read
        batch_size = _int_in(batch_size, "batch_size", 1, MAX_TRAIN_BATCH_SIZE)
        if threads is not None:
            threads = _int_in(threads, "threads", 1, MAX_TRAIN_THREADS,
                              f"1..{MAX_TRAIN_THREADS} or None (all cores)")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"pattern: got {_short_repr(pattern)}; accepted: a non-empty regex str")
        rustbpe = _rustbpe()
        # before the text is read, not after hours of training (with rustbpe's structural check: a
        # pattern that can match the empty string passes every probe its other alternatives cover)
        _check_pattern(pattern)
        if isinstance(texts, (str, bytes, bytearray)):  # iterable, but one "document" per character
            raise ValueError(f"texts: got {type(texts).__name__} {texts[:40]!r}; accepted: an iterable "
                             "of str documents (wrap a single text in a list)")
        try:
            texts = iter(texts)
        except TypeError:
            raise ValueError(f"texts: got {type(texts).__name__}; accepted: an iterable of str documents") from None
        first = next(texts, _NO_DOCUMENT)  # checked here so the message does not depend on the Rust side
        if first is _NO_DOCUMENT:
            raise ValueError("texts: got no documents; accepted: a non-empty iterable of str")
        counter = _DocCounter(itertools.chain([first], texts))
        trainer = rustbpe.Tokenizer()
        # threads as an argument, not RAYON_NUM_THREADS set around the call: os.environ is process-wide
        # (other threads saw it; two concurrent calls could leave it set for good)
        try:
            trainer.train_from_iterator(counter, vocab_size - len(SPECIAL_TOKENS), buffer_size=batch_size,
                                        pattern=pattern, threads=threads)
        except ValueError as e:  # rustbpe names its own parameter, `iterator`; this caller passed `texts`
            if not str(e).startswith("iterator: "):
                raise
            # rustbpe numbers the pieces it was handed; the item it refused is the last document read
            why = re.sub(r"^item \d+ ", f"item {counter.docs - 1} ", str(e).removeprefix("iterator: "))
            raise ValueError("texts: " + why) from None
        ranks_list = trainer.get_mergeable_ranks()
        ranks = {bytes(tok): int(rank) for tok, rank in ranks_list}
        # Duplicate token bytes would collapse in the dict and leave a hole in the ranks.
        assert len(ranks) == len(ranks_list), "rustbpe returned duplicate tokens"
        got = len(ranks) + len(SPECIAL_TOKENS)
        if got != vocab_size:
            raise VocabTooLargeError(
                f"vocab_size: requested {vocab_size} but {counter.docs} documents "
                f"({counter.chars:,} chars) only support {got}; accepted: a smaller vocab_size "
                "or more training text", got)
        assert trainer.get_pattern() == pattern, "rustbpe changed the split pattern"
        return cls(pattern, ranks)

    # ------------------------------------------------------------------ persistence

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.pkl and token_bytes.pt into `directory` (created if needed)."""
        import torch

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        payload = {"format_version": FORMAT_VERSION, "pattern": self._pattern,
                   "mergeable_ranks": self._ranks, "special_tokens": list(self._specials),
                   "fingerprint": self._fingerprint}
        token_bytes = self.token_bytes()
        # tokenizer.pkl is replaced last: it says which tokenizer the directory holds
        _atomic_write_all([(directory / TOKEN_BYTES_NAME, lambda f: torch.save(token_bytes, f)),
                           (directory / PICKLE_NAME, lambda f: pickle.dump(payload, f, protocol=4))])

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        """Read directory/tokenizer.pkl; TokenizerError (naming the path) if missing or corrupt. A split
        pattern that leaves some characters unmatched loads with a DroppedTextWarning (once per file and
        process): refusing it stranded every checkpoint built on the tokenizer."""
        path = Path(directory) / PICKLE_NAME
        if not path.is_file():
            raise TokenizerError(path, "file not found")
        try:
            data = path.read_bytes()
            _check_pickle_bounds(data)
            payload = _SafeUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
                AttributeError, OverflowError) as e:
            raise TokenizerError(path, f"corrupt file ({type(e).__name__}: {e})") from e
        except OSError as e:
            raise TokenizerError(path, f"cannot read file ({e})") from e
        if not isinstance(payload, dict):
            raise TokenizerError(path, "corrupt file (not a tokenizer record)")
        version = payload.get("format_version")
        if version != FORMAT_VERSION:
            raise TokenizerError(path, f"format version {_short_repr(version)} unsupported (this code reads "
                                       f"{FORMAT_VERSION})")
        try:
            tok = cls._existing(payload["pattern"], payload["mergeable_ranks"], payload["special_tokens"])
        except (KeyError, TypeError, ValueError, RecursionError) as e:   # RecursionError: nested junk
            stored = payload.get("fingerprint")   # a str: a record without one is not judged intact
            if isinstance(e, ValueError) and str(e).startswith("pattern:") and isinstance(stored, str) and \
                    _fingerprint_of(payload) == stored:
                # intact, but its split pattern is one this code refuses (a rule newer than the file: \K)
                raise TokenizerError(path, f"its split pattern is refused ({e}); retrain it (tok_train's "
                                           "default pattern, or Tokenizer.train(pattern=...))") from e
            raise TokenizerError(path, f"corrupt file ({type(e).__name__}: {e})") from e
        if payload.get("fingerprint") != tok.fingerprint:
            raise TokenizerError(path, "corrupt file (stored fingerprint does not match contents)")
        if tok._drops is not None:
            warn_dropped_text(path, tok.pattern, tok._drops)
        return tok

    # ------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def bos_token_id(self) -> int:
        return self._special_ids["<|bos|>"]

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def pattern(self) -> str:
        return self._pattern

    @property
    def special_tokens(self) -> list[str]:
        return list(self._specials)

    def token_bytes(self) -> "torch.Tensor":
        import torch

        lengths = [0] * self.vocab_size  # special tokens stay 0: they carry no text bytes
        for tok, rank in self._ranks.items():
            lengths[rank] = len(tok)
        return torch.tensor(lengths, dtype=torch.int32)

    # ------------------------------------------------------------------ encode / decode

    def encode_special(self, name: str) -> int:
        try:
            return self._special_ids[name]
        except (KeyError, TypeError):
            raise ValueError(f"special token: got {_short_repr(name)}; accepted: {', '.join(self._specials)}") from None

    def _resolve_token(self, token, arg: str) -> int | None:
        if token is None:
            return None
        accepted = f"a token id in 0..{self.vocab_size - 1} or a special-token name"
        if isinstance(token, str):   # encode_special's message named no argument
            if token not in self._special_ids:
                raise ValueError(f"{arg}: got {_short_repr(token)}; accepted: {accepted} ({', '.join(self._specials)})")
            return self._special_ids[token]
        return _int_in(token, arg, 0, self.vocab_size - 1, accepted)

    def encode(self, text: str | list[str], prepend: int | str | None = None,
               append: int | str | None = None, num_threads: int = 8) -> list[int] | list[list[int]]:
        """Encode ordinary text (special-token strings in it are just text). A list is encoded in
        parallel with `num_threads` threads and gives a list of id lists. A lone surrogate (not
        UTF-8) encodes as U+FFFD, not an error: the calculator's output is encoded mid-generation;
        the boundaries that take text from users (chat_cli, conversation files) refuse it first."""
        pre = self._resolve_token(prepend, "prepend")
        post = self._resolve_token(append, "append")
        if isinstance(text, str):
            batch, single = [text], True
        elif isinstance(text, (list, tuple)):
            bad = next((i for i, t in enumerate(text) if not isinstance(t, str)), None)
            if bad is not None:   # "got list; accepted: list[str]" did not say which item was wrong
                raise TypeError(f"text[{bad}]: got {type(text[bad]).__name__} {_short_repr(text[bad], 40)}; "
                                "accepted: str or list[str]")
            batch, single = text, False
        else:
            raise TypeError(f"text: got {type(text).__name__}; accepted: str or list[str]")
        if single:
            rows = [self._encode_ordinary(text)]
        else:
            rows = encode_ordinary_batch(self._enc, batch, _positive_int(num_threads, "num_threads"))
        if pre is not None:
            rows = [[pre] + row for row in rows]
        if post is not None:
            for row in rows:
                row.append(post)
        return rows[0] if single else rows

    def _encode_ordinary(self, text: str) -> list[int]:
        return encode_ordinary(self._enc, text)

    def _check_ids(self, ids) -> list[int]:
        if isinstance(ids, (str, bytes)):   # a str is a sequence too: "12" decoded as ids 1 and 2
            raise ValueError(f"ids: got {type(ids).__name__}; accepted: a sequence of token ids")
        try:   # operator.index: ints, numpy ints and integer tensor elements; not 1.7 or "1"
            ids = [operator.index(i) for i in ids]
        except TypeError as e:
            raise ValueError(f"ids: {e}; accepted: a sequence of integer token ids") from None
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            # _short_repr: formatting an int of 4,300+ digits raised its own ValueError, naming no argument
            raise ValueError(f"ids: got token id {_short_repr(bad)}; accepted: 0..{self.vocab_size - 1}")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids back to text; special tokens appear by name, invalid UTF-8 as U+FFFD."""
        return self._enc.decode(self._check_ids(ids))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Ids back to their bytes, which need not end on a UTF-8 character boundary (streaming)."""
        return self._enc.decode_bytes(self._check_ids(ids))

    def id_to_token(self, i: int) -> str:
        (i,) = self._check_ids([i])
        return self._enc.decode_single_token_bytes(i).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ chat rendering

    def _render(self, messages: list[tuple[int, str, object]]) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []

        def add(tokens: list[int], m: int) -> None:
            ids.extend(tokens)
            mask.extend([m] * len(tokens))

        sp = self._special_ids
        add([self.bos_token_id], 0)
        for i, role, content in messages:
            if role == "user":
                add([sp["<|user_start|>"]] + self._encode_ordinary(content) + [sp["<|user_end|>"]], 0)
                continue
            add([sp["<|assistant_start|>"]], 0)  # given by the prompt, never predicted
            for kind, text in _assistant_parts(i, content):
                tokens = self._encode_ordinary(text)
                if kind == "text":
                    add(tokens, 1)
                elif kind == "python":  # the model writes the tool call: trained on
                    add([sp["<|python_start|>"]] + tokens + [sp["<|python_end|>"]], 1)
                else:  # the tool's output is forced in by the engine: not trained on
                    add([sp["<|output_start|>"]] + tokens + [sp["<|output_end|>"]], 0)
            add([sp["<|assistant_end|>"]], 1)  # the model must learn to stop
        return ids, mask

    def render_conversation(self, conversation: dict, max_tokens: int = 2048) -> tuple[list[int], list[int]]:
        """Token ids and a 0/1 training mask (1 = assistant-written tokens), cut to max_tokens."""
        max_tokens = _positive_int(max_tokens, "max_tokens")
        ids, mask = self._render(_normalized_messages(conversation))
        return ids[:max_tokens], mask[:max_tokens]

    def render_for_completion(self, conversation: dict) -> list[int]:
        """Prompt ids for the model to continue as the assistant: the last message is dropped when
        it is the assistant's (the answer to predict), and <|assistant_start|> is appended."""
        messages = _normalized_messages(conversation)
        if messages[-1][1] == "assistant":
            messages = messages[:-1]
        ids, _ = self._render(messages)
        return ids + [self._special_ids["<|assistant_start|>"]]

    def visualize(self, ids: Sequence[int], mask: Sequence[int] | None = None, color: bool = True) -> str:
        """Debug view of a rendering: tokens separated by '|', trained (mask 1) tokens in green and
        the rest in red (or, with color=False, trained tokens wrapped in [ ])."""
        ids = self._check_ids(ids)
        if mask is not None and len(mask) != len(ids):
            raise ValueError(f"mask: got length {len(mask)}; accepted: the length of ids ({len(ids)})")
        pieces = []
        for k, i in enumerate(ids):
            text = self.id_to_token(i).replace("\n", "\\n")
            trained = mask is not None and mask[k] == 1
            if color:
                pieces.append(f"\033[{'92' if trained else '91'}m{text}\033[0m" if mask is not None else text)
            else:
                pieces.append(f"[{text}]" if trained else text)
        return "|".join(pieces)


class _DocCounter(Iterator[str]):
    """Wraps the training texts: counts documents and characters, rejects non-str items early, and
    yields each document as encode()'s whitespace_pieces: training sees the chunks encoding makes, and
    a custom pattern (fancy-regex in rustbpe) no longer hits its backtracking limit on a ~1M run."""

    def __init__(self, texts: Iterable[str]):
        self._it = iter(texts)
        self._pending: list[str] = []   # the rest of the current document's pieces, reversed
        self.docs = 0
        self.chars = 0

    def __next__(self) -> str:
        if self._pending:
            return self._pending.pop()
        text = next(self._it)
        if not isinstance(text, str):
            raise ValueError(f"texts[{self.docs}]: got {type(text).__name__}; accepted: str")
        self.docs += 1
        self.chars += len(text)
        first, *rest = whitespace_pieces(text)
        self._pending = rest[::-1]
        return first


def tokenizer_dir(base_dir: Path | None = None) -> Path:
    """Where the project tokenizer lives: base_dir/tokenizer (base_dir defaults to get_base_dir())."""
    if base_dir is None:
        from nanochat.common import get_base_dir

        base_dir = get_base_dir()
    return Path(base_dir) / "tokenizer"


def get_tokenizer(base_dir: Path | None = None) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir(base_dir))


def get_token_bytes(device="cpu", base_dir=None) -> "torch.Tensor":
    """token_bytes.pt of the project tokenizer, checked against tokenizer.pkl, on `device`."""
    import torch

    directory = tokenizer_dir(base_dir)
    path = directory / TOKEN_BYTES_NAME
    tok = Tokenizer.load(directory)  # also validates the tokenizer the lengths belong to
    if not path.is_file():
        raise TokenizerError(path, "file not found")
    try:
        token_bytes = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError, struct.error,
            KeyError, IndexError, TypeError, AttributeError) as e:  # what torch.load raises on junk
        raise TokenizerError(path, f"corrupt file ({type(e).__name__}: {e})") from e
    if not isinstance(token_bytes, torch.Tensor) or token_bytes.dtype != torch.int32 \
            or not torch.equal(token_bytes, tok.token_bytes()):
        raise TokenizerError(path, f"does not match {directory / PICKLE_NAME}")
    return token_bytes.to(device)
