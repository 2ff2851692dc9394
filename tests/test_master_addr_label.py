"""A MASTER_ADDR with an empty or over-long label ("10.0..1", a typo) makes getaddrinfo raise
UnicodeError (the idna codec), not gaierror: it is named as MASTER_ADDR like any address that does
not resolve, not a traceback (found by the session's read-only review)."""

import pytest

from nanochat.common import _check_master_env
from nanochat.errors import RequestError


@pytest.mark.parametrize("addr", ["10.0..1", "a..b", "x" * 64 + ".example"])
def test_a_malformed_label_is_named_as_master_addr(addr):
    with pytest.raises(RequestError, match=rf"^MASTER_ADDR: got '{addr}', which does not resolve"):
        _check_master_env(addr, "29500", 2)
