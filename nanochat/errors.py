"""The exception types the library raises for command-line requests and the scripts report as one
line (nanochat.flags.script_main). Imports nothing, so torch-free modules (tokenizer.py) can use it."""


class RequestError(ValueError):
    """A command-line request that is invalid or that this machine or its files cannot meet, found
    after the flags parsed (e.g. --precision nvfp4 on a Hopper GPU, --device cuda without a GPU, an
    attention backend whose package is missing, a tokenizer or checkpoint that is not there). It
    names the flag or the path and what to do instead. Scripts run under
    `script_main` print it as one line and exit 2, before any expensive work; a plain ValueError
    from deeper code is a bug and keeps its traceback. A ValueError, so callers that catch bad
    input keep working."""


class MissingDataError(FileNotFoundError, RequestError):
    """Files a request needs are not there (pretraining shards, binary token shards, an eval bundle,
    a task's dataset); the message names where it looked and how to get them. Both a
    FileNotFoundError and a RequestError (one line from the scripts)."""


class DataError(RequestError):
    """A data file is unreadable, corrupt or inconsistent (a truncated or non-parquet text shard, a
    row group that does not decompress, a binary token shard with a bad header or made with another
    tokenizer, an invalid JSONL line); the message names the file and how to re-create it. Files
    that are not there, or hold nothing, are a MissingDataError instead."""


class DiskFullError(RequestError):
    """A disk has no room for what a request writes (downloaded shards); the message names the
    directory, what is needed and what is free, and that finished work is kept for a rerun."""
