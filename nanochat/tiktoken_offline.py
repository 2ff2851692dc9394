"""GPT-2 and GPT-4 (cl100k_base) tiktoken encodings, loaded from tiktoken's on-disk cache only.

scripts/tok_eval compares our tokenizer's compression with them when they are cached, and never
downloads them: tiktoken has no offline switch, so `no_downloads()` swaps its file reader (the
one function its cache falls back to for a fetch) for one that refuses URLs, for the duration of
a load. It relies on `tiktoken.load.read_file` being that function; tests/test_tokenizer.py checks
it on the installed tiktoken (a fetch through the cache is refused, a cached file still served).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import tiktoken

REFERENCES = [("gpt2", "GPT-2"), ("cl100k_base", "GPT-4")]


class DownloadBlocked(Exception):
    """A load that would have fetched this URL from the network."""


@contextlib.contextmanager
def no_downloads():
    """Make tiktoken's file reader refuse URLs, so only its on-disk cache can satisfy a load.
    read_file is the single function tiktoken's cache falls back to for fetching."""
    import tiktoken.load as tl

    original = tl.read_file

    def offline_read(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise DownloadBlocked(blobpath)
        return original(blobpath)

    tl.read_file = offline_read
    try:
        yield
    finally:
        tl.read_file = original


def tiktoken_cache_dir() -> str:
    """The directory tiktoken reads cached encoding files from (same rule as tiktoken.load)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def load_reference(name: str) -> tuple[tiktoken.Encoding | None, str | None]:
    """(encoding, None) when tiktoken can build it offline, else (None, why it was skipped)."""
    cache = tiktoken_cache_dir()
    if cache == "":
        return None, "TIKTOKEN_CACHE_DIR is empty (caching off), so loading would download"
    try:
        with no_downloads():
            return tiktoken.get_encoding(name), None
    except DownloadBlocked as e:
        return None, f"not in tiktoken's cache {cache} (loading would download {e.args[0]})"
    except OSError as e:  # tiktoken opens a cached entry unguarded: another user's 0600 file in a
        # shared /tmp/data-gym-cache, or a directory in its place, ended tok_eval with a traceback
        return None, f"cannot read tiktoken's cache {cache} ({type(e).__name__}: {e})"
