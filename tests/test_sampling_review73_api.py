"""The API's seed mapping (nanochat/chat_api.py) is injective: OpenAI's seed is any int64, the
Engine's seeds are 0..MAX_SEED (2**64 - 1), and `seed % 2**63` sent -1 and 2**63 - 1 (every
negative seed and its non-negative twin) to the same seed, so two clients' seeds drew the same
answer. `seed % 2**64` (the int64's two's-complement bits read as unsigned) is one-to-one and
leaves every non-negative seed as it was."""

import pytest

from nanochat.chat_api import ApiError, ServerSettings, parse_chat_request
from nanochat.sampling import MAX_SEED

SETTINGS = ServerSettings().validate()
USER = [{"role": "user", "content": "q"}]


def seed_of(seed):
    return parse_chat_request({"messages": USER, "seed": seed}, SETTINGS).seed


def test_every_int64_seed_maps_to_its_own_engine_seed():
    seeds = [-2**63, -2**63 + 1, -2**32, -3, -1, 0, 1, 7, 2**32 - 1, 2**32, 2**62, 2**63 - 3, 2**63 - 1]
    mapped = [seed_of(s) for s in seeds]
    assert len(set(mapped)) == len(seeds), dict(zip(seeds, mapped))
    assert all(0 <= m <= MAX_SEED for m in mapped)
    assert [seed_of(s) for s in (0, 7, 2**63 - 1)] == [0, 7, 2**63 - 1]      # non-negative: as sent
    assert seed_of(-1) == MAX_SEED and seed_of(-2**63) == 2**63
    for bad in (2**63, -2**63 - 1):
        with pytest.raises(ApiError):
            seed_of(bad)
