"""Shared pytest setup: CUDA tests skip cleanly without a GPU; paths to the offline data."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("NANOCHAT_SHARED_DATA", REPO.parent / "shared" / "data"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on the GPU box)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"offline data not found at {SHARED_DATA}; set NANOCHAT_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_corpus(shared_data) -> Path:
    """Directory holding the Shakespeare train/val parquet shards."""
    return shared_data / "pretrain" / "tiny"
