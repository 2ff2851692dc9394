"""Eighth review of the chat server, as a demanding client writing request bodies by hand (curl,
PowerShell, a script): a body that is not JSON is refused with what is wrong and where (it was a
bare "could not parse JSON"); a UTF-8 byte-order mark is still accepted."""

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from test_chat_web import ScriptedEngine, assert_error, serve  # noqa: E402,F401  (serve: the fixture)

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    from test_engine import tiny_chat_model

    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_chat_web's


@pytest.mark.parametrize("body, said", [
    (b'{"messages": [{"role": "user", "content": "Hi"}],}', "Expecting property name enclosed in double quotes "
                                                            "at line 1 column 50"),   # a trailing comma
    (b'{"messages": [{"role": "user",\n "content": Hi}]}', "Expecting value at line 2 column 13"),   # lost quotes
    (b"", "the body is empty"),                                                            # curl -X POST alone
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "byte 46 is not UTF-8"),  # a Latin-1 file
    (b'{"messages": [{"role": "user", "content": "Hi"}]} {}', "Extra data at line 1 column 51"),
])
def test_a_body_that_is_not_json_is_refused_saying_what_and_where(serve, chat_model, body, said):  # noqa: F811
    url = serve(ScriptedEngine(chat_model[1], "Hello"))
    r = httpx.post(url + "/v1/chat/completions", content=body, headers=JSON, timeout=30)
    err = assert_error(r, 400, code="invalid_json")
    assert said in err["message"] and "accepted: a JSON object" in err["message"], err["message"]
    # the server goes on serving; a body with a UTF-8 byte-order mark (PowerShell's utf8) is JSON
    ok = httpx.post(url + "/v1/chat/completions", headers=JSON, timeout=30,
                    content=b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}')
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_host_in_url_brackets_and_unresolvable_names():
    """`--host [::1]` (the form the server prints its URL in) was refused as "Name or service not
    known; stop the server using that port", which reads as a port clash; it is ::1. A name that
    does not resolve is said to be that, not a taken port."""
    from nanochat.errors import RequestError
    from nanochat.serve_lifecycle import check_port_free
    from scripts import chat_web

    args = chat_web.parse_args(["--host", "[::1]"])
    chat_web.validate(args)
    assert args.host == "::1" and chat_web.is_loopback(args.host)
    with pytest.raises(RequestError, match=r"'no-such-host\.invalid' is not an address of this machine or a name "
                                           r"that resolves .*accepted: 127\.0\.0\.1, ::1") as e:
        check_port_free("no-such-host.invalid", 8000)
    assert "stop the server using that port" not in str(e.value)
