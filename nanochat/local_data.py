"""A local directory of documents -> pretraining text shards: `python -m nanochat.dataset
--data-dir SRC` (the command line lives in nanochat/dataset.py, which also resolves these names).

Every *.parquet (string column `text`), *.jsonl (one JSON object a line with a string field
`text`) and *.txt (one document per file, split when long: at blank lines, else at line ends;
line ends read as Python's text mode reads them) under SRC (symlinked folders followed, each real
folder once), suffixes in any case, sorted by path, becomes one document list (hidden files and
directories, such as macOS `._NAME` resource forks and `.ipynb_checkpoints/`, are not read, nor a
byte-identical copy of an earlier file; the command says how many files it read and skipped, naming
the copies and any folder it could not list); the last `val_fraction` of it is the
validation shard, and a training document that copies a validation one (whitespace aside) is left
out of train (held_out_split). A file that does not read as what its suffix says (not UTF-8, not JSON, no
`text`, a lone surrogate escape) is a DataError naming the file, and the line for JSONL (a .txt
file: the byte). The shards in the output directory are skipped, so that an --out inside SRC
does not feed a rerun its own earlier shards (the old validation shard among them) as new
training documents; so are those of an earlier import of SRC into another folder inside it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Iterable, NamedTuple

from nanochat.binshards_runs import file_sha256
from nanochat.dataset import (SOURCE_FILE, claim_data_dir, open_text_shard, read_marker, read_row_group_texts,
                              write_text_shards)
from nanochat.errors import DataError

SUFFIXES = (".parquet", ".jsonl", ".txt")
MAX_DOC_CHARS = 20_000   # a .txt file longer than this is split (_split_long)
_SHARD_NAME = re.compile(r"shard_\d{5,}\.parquet")   # dataset.shard_name's: what an --out holds of ours


def chunk_paragraphs(paragraphs: Iterable[str], target: int, sep: str = "\n\n") -> list[str]:
    """Join paragraphs (with `sep`, a blank line) into n = ceil(len / target) chunks of about equal
    size: a chunk closes once it passes len / n characters (the last takes the rest)."""
    paras = list(paragraphs)
    total = len(sep.join(paras))
    n = max(1, math.ceil(total / target))
    chunks, cur, size = [], [], -len(sep)  # size = len(sep.join(cur))
    for p in paras:
        cur.append(p)
        size += len(p) + len(sep)
        if size > total / n and len(chunks) < n - 1:
            chunks.append(sep.join(cur))
            cur, size = [], -len(sep)
    if cur:
        chunks.append(sep.join(cur))
    return chunks


def _split_long(text: str, max_chars: int) -> list[str]:
    """Split text into pieces of about max_chars: at blank lines; a piece still over twice that (a
    file whose paragraphs are single lines, or that has no blank line at all) at line ends, then a
    line still over it at spaces (or anywhere). Kept whole, such a piece would be one document, of
    which the dataloader trains on one row (~8 KB) and drops the rest (a whole book)."""
    if len(text) <= max_chars:
        return [text]
    out = []
    for chunk in chunk_paragraphs(re.split(r"\n[ \t]*\n", text), max_chars):
        lines = chunk_paragraphs(chunk.split("\n"), max_chars, "\n") if len(chunk) > 2 * max_chars else [chunk]
        out += [piece for line in lines for piece in _cut(line, max_chars)]
    return out


def _cut(text: str, max_chars: int) -> list[str]:
    """text in pieces of at most max_chars when it is over twice that, each cut after the last
    space of its window when there is one (a hard cut otherwise); "".join gives text back."""
    if len(text) <= 2 * max_chars:
        return [text]
    pieces, start = [], 0
    while len(text) - start > max_chars:
        space = text.rfind(" ", start + max_chars // 2, start + max_chars)
        end = space + 1 if space >= 0 else start + max_chars
        pieces.append(text[start:end])
        start = end
    return pieces + [text[start:]]


def _jsonl_texts(path: Path) -> list[str]:
    """The non-empty `text` fields of a JSONL file. Lines are decoded one by one (not by opening
    the file as UTF-8) so that a bad byte is reported with its line, like bad JSON."""
    texts = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: not valid UTF-8 (byte {e.start}: {e.reason}); "
                                "re-encode the file as UTF-8") from None
            if n == 1:   # a byte-order mark (Windows editors write one): json.loads refuses it
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e})") from e
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise DataError(f"{path}:{n}: expected an object with a string field 'text'")
            if "\\u" in line:   # only a \uXXXX escape can make a lone surrogate (json.loads allows it)
                _check_encodable(rec["text"], path, n)
            if rec["text"]:
                texts.append(rec["text"])
    return texts


def _check_encodable(text: str, path: Path, line: int) -> None:
    """DataError naming the line for a text holding a lone surrogate (JSON's "\\ud800"): no UTF-8
    has it, so writing the shard failed later with an encode error that named no file."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{path}:{line}: 'text' holds a lone surrogate escape ({text[e.start]!r} at character "
                        f"{e.start}), which is not valid Unicode; fix or drop that record") from None


def _txt_text(path: Path) -> str:
    """A .txt file's text with its line ends as Python's text mode reads them (\r\n and \r ->
    \n): a Windows / Project Gutenberg file then splits at its blank lines too, instead of staying
    one document the dataloader crops to a single row. A byte that is not UTF-8 is a DataError
    (decoding with replacement would train on U+FFFD in place of every accented letter of, say, a
    Latin-1 file)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 (byte {e.start}: {e.reason}); re-encode the file "
                        "as UTF-8") from None
    # a leading byte-order mark (Windows editors write one) is not text: it would train as U+FEFF
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


class LocalFiles(NamedTuple):
    read: list[Path]        # *.parquet, *.jsonl, *.txt under src, to read
    other: list[Path]       # files of other kinds (named in the import's log line)
    derived: list[Path]     # folders holding an earlier import of src (or of a folder in it): not read
    unreadable: list[Path]  # folders that could not be listed (named in the log line)


def _walk(src: Path) -> tuple[list[Path], list[Path]]:
    """(every file under src, hidden ones and those in hidden directories aside; the directories
    that could not be listed). Symlinked directories are followed, each real directory once (a
    link loop ends): rglob skipped them without a word, so a corpus assembled from links (`ln -s
    /mnt/big/wiki corpus/`) was imported without those documents."""
    files, unreadable, seen = [], [], set()
    for root, dirs, names in os.walk(src, onerror=lambda e: unreadable.append(Path(e.filename)), followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [Path(root, n) for n in names if not n.startswith(".")]
    return sorted(files), sorted(unreadable)


def _derived_dirs(src: Path, files: list[Path]) -> set[Path]:
    """Folders among `files`' whose source.json records a local import of src or of a folder
    inside it that is still there: their shards copy documents this import reads from their own
    files (an earlier `--out src/v1`, imported again into src/v2, trained on every document twice).
    A set whose source folder is gone, or that came from elsewhere or a download, is read."""
    root, derived = src.resolve(), set()
    for marker in (f for f in files if f.name == SOURCE_FILE):
        try:
            source = read_marker(marker) or {}
        except DataError:   # not a marker of ours: the folder is read as it is
            continue
        origin = source.get("source")
        if isinstance(origin, str) and origin.startswith("local:"):
            origin = Path(origin[len("local:"):])
            if origin.is_dir() and (origin == root or root in origin.parents):
                derived.add(marker.parent)
    return derived


def local_files(src: Path, exclude: Path | None = None) -> LocalFiles:
    """The files under src, sorted by path. To read: *.parquet, *.jsonl, *.txt, the suffix in any
    case (`NOTES.TXT` from Windows), except the shards and source marker directly in `exclude` (the
    output directory; by name, shard_NNNNN.parquet) or in a folder holding an earlier import of
    src (_derived_dirs). Hidden files and directories are not listed: a `._NAME.txt` resource fork
    (in any tar made on a Mac) is binary, a `.ipynb_checkpoints/` copy a duplicate."""
    skip = exclude.resolve() if exclude is not None else None
    files, unreadable = _walk(src)
    derived = _derived_dirs(src, files)
    read, other, skipped = [], [], set()
    for p in files:
        if not p.is_file():   # a broken link, a socket
            continue
        # only the names write_text_shards gives: a user's own mydata.parquet in --out (--out = SRC)
        # was skipped too, and the import said there were no .parquet files under SRC
        ours = _SHARD_NAME.fullmatch(p.name) is not None or p.name == SOURCE_FILE
        if ours and skip is not None and p.parent.resolve() == skip:
            continue
        if ours and p.parent in derived:
            skipped.add(p.parent)
            continue
        (read if p.suffix.lower() in SUFFIXES else other).append(p)
    return LocalFiles(read, other, sorted(skipped), unreadable)


def drop_copies(files: list[Path]) -> tuple[list[Path], list[tuple[Path, Path]]]:
    """(files without byte-identical copies of an earlier one, [(copy, the file it copies)]). A
    folder holding `corpus.jsonl` and `corpus (1).jsonl` (a second download, a backup) read every
    document twice, and with the copy's documents at the end of the order, validated on training
    documents. Only non-empty files of equal size are hashed."""
    by_size: dict[int, list[Path]] = {}
    for p in files:
        by_size.setdefault(p.stat().st_size, []).append(p)
    first: dict[str, Path] = {}
    copies = []
    for size, same in by_size.items():
        if size == 0 or len(same) < 2:
            continue
        for p in same:
            original = first.setdefault(file_sha256(p), p)
            if original is not p:
                copies.append((p, original))
    dropped = {c for c, _ in copies}
    return [p for p in files if p not in dropped], copies


def read_local_documents(src: Path, *, max_doc_chars: int = MAX_DOC_CHARS, exclude: Path | None = None) -> list[str]:
    """Documents from every *.parquet (`text` column), *.jsonl (`text` field) and *.txt (one
    document per file, split (_split_long) when longer than max_doc_chars) under src, sorted
    (local_files says which files: not the shards in `exclude`, the output directory)."""
    return _read_files(src, local_files(src, exclude)[0], max_doc_chars)


def _read_files(src: Path, files: list[Path], max_doc_chars: int) -> list[str]:
    if not files:
        raise ValueError(f"--data-dir: no .parquet, .jsonl or .txt files under {src}")
    docs = []
    for path in files:
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            pf = open_text_shard(path)
            docs += [t for rg in range(pf.num_row_groups) for t in read_row_group_texts(pf, rg, path) if t]
        elif suffix == ".jsonl":
            docs += _jsonl_texts(path)
        else:
            text = _txt_text(path).strip()
            if text:
                docs += _split_long(text, max_doc_chars)
    return docs


def import_local_dir(src: Path, out_dir: Path, *, val_fraction: float = 0.05,
                     shard_chars: int = 100_000_000, log=print) -> list[Path]:
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction: got {val_fraction}; accepted: 0 < x < 1")
    found = local_files(src, exclude=out_dir)
    files, copies = drop_copies(found.read)
    docs = _read_files(src, files, MAX_DOC_CHARS)
    skipped = _skip_note(src, found, copies)
    log(f"read {len(docs)} documents from {len(files)} files under {src}{skipped}")
    n_val = max(1, round(len(docs) * val_fraction))
    if len(docs) < 2:
        raise ValueError(f"--data-dir: {src} holds {len(docs)} document(s); need at least 2 "
                         "(train + validation)")
    if len(docs) - n_val < 1:   # enough documents, but the fraction takes them all: say which flag
        raise ValueError(f"--val-fraction: got {val_fraction}, which holds out all {len(docs)} documents of "
                         f"{src} and leaves none to train on; accepted: 0 < x < {(len(docs) - 0.5) / len(docs):.3g} "
                         "for this many documents")
    train, val = held_out_split(docs, n_val, src, log)
    claim_data_dir(out_dir, f"local:{src.resolve()}", {"val_fraction": val_fraction})
    return write_text_shards(out_dir, train, val, shard_chars=shard_chars)


def _skip_note(src: Path, found: LocalFiles, copies: list[tuple[Path, Path]]) -> str:
    """What the import left out, for its log line: "; skipped ..." per kind (or "")."""
    def listed(paths, show=str) -> str:
        return ", ".join(show(p) for p in paths[:5]) + (" ..." if len(paths) > 5 else "")

    def rel(p: Path) -> str:
        return str(p.relative_to(src)) if p != src else "."

    def n(k: int, one: str, many: str) -> str:
        return f"{k} {one if k == 1 else many}"

    parts = [f"{n(len(found.other), 'file that is', 'files that are')} not .parquet/.jsonl/.txt: "
             f"{listed(found.other, rel)}" if found.other else "",
             f"{n(len(copies), 'exact copy', 'exact copies')} of another file: "
             f"{listed(copies, lambda c: f'{rel(c[0])} (= {rel(c[1])})')}" if copies else "",
             f"the shards of {n(len(found.derived), 'earlier import', 'earlier imports')} of this folder "
             f"(its documents are read from their own files): {listed(found.derived, rel)}" if found.derived else "",
             f"{n(len(found.unreadable), 'folder', 'folders')} that could not be listed (permissions?): "
             f"{listed(found.unreadable, rel)}" if found.unreadable else ""]
    return "".join(f"; skipped {part}" for part in parts if part)


def _doc_key(text: str) -> bytes:
    """A document's identity for the train/val check: its words, whitespace normalised (a copy
    re-wrapped or re-indented is the same document), hashed to 16 bytes to keep the set small."""
    return hashlib.blake2b(" ".join(text.split()).encode("utf-8"), digest_size=16).digest()


def held_out_split(docs: list[str], n_val: int, src: Path, log=print) -> tuple[list[str], list[str]]:
    """(train, val): the last n_val documents are validation, and every training document that is
    a copy of one of them (whitespace aside) is left out of train. A corpus holding the same text
    twice (a page saved twice, a post quoted whole, boilerplate) had such a copy on both sides:
    the model was validated on documents it trained on, and val bpb read better than it was."""
    val = docs[-n_val:]
    held = {_doc_key(d) for d in val}
    train = [d for d in docs[:-n_val] if _doc_key(d) not in held]
    if len(train) < len(docs) - n_val:
        log(f"left out {len(docs) - n_val - len(train)} training document(s) that copy a held-out "
            "(validation) document")
    if not train:
        raise ValueError(f"--data-dir: every training document under {src} is a copy of a held-out "
                         "(validation) document; add distinct documents")
    return train, val
