"""Review of how conversations become training rows (nanochat/tokenizer.py's rendering,
nanochat/chat_data.py's packing): the exact token / target layout of a hand-built SFT row (the
assistant's text and tool calls trained, the forced tool output, user turns, the next
conversation's <|bos|> and the padding not), mid-training's crop rows, the prompt the engine and
server build being the training rendering's prefix, conversations_truncated counting only
conversations that were packed (not the read-ahead buffer), and an --extra-conversations warning
naming the right line of a file that starts with a byte-order mark.
Fixtures (tiny_tokenizer): tests/conftest.py."""

from __future__ import annotations

import json

import pytest

from nanochat.chat_data import ChatLoader, check_replies_fit


def conv(user: str, reply, system: str | None = None) -> dict:
    msgs = [{"role": "system", "content": system}] if system is not None else []
    return {"messages": msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


TOOL_REPLY = [{"type": "text", "text": "ok "}, {"type": "python", "text": "1+2"},
              {"type": "python_output", "text": "3"}, {"type": "text", "text": " done"}]


def test_sft_row_layout_trains_exactly_the_assistants_tokens(tiny_tokenizer):
    """Two conversations packed into one padded row: targets are exactly the next token where it is
    the assistant's (text, <|python_start|>..<|python_end|>, <|assistant_end|>), -1 for the user
    turn, <|assistant_start|>, the forced <|output_start|>..<|output_end|>, the next conversation's
    <|bos|> and the padding."""
    tok = tiny_tokenizer
    sp, enc = tok.encode_special, tok.encode
    a, b = conv("hi", TOOL_REPLY, system="Be brief."), conv("q", "yes")
    ids_a = ([tok.bos_token_id, sp("<|user_start|>")] + enc("Be brief.\n\nhi") + [sp("<|user_end|>"),
             sp("<|assistant_start|>")] + enc("ok ") + [sp("<|python_start|>")] + enc("1+2") +
             [sp("<|python_end|>"), sp("<|output_start|>")] + enc("3") + [sp("<|output_end|>")] + enc(" done") +
             [sp("<|assistant_end|>")])
    trained_a = set(range(ids_a.index(sp("<|assistant_start|>")) + 1, ids_a.index(sp("<|output_start|>")))) | \
        set(range(ids_a.index(sp("<|output_end|>")) + 1, len(ids_a)))
    ids_b = [tok.bos_token_id, sp("<|user_start|>")] + enc("q") + [sp("<|user_end|>"), sp("<|assistant_start|>")] + \
        enc("yes") + [sp("<|assistant_end|>")]
    trained_b = set(range(ids_b.index(sp("<|assistant_start|>")) + 1, len(ids_b)))
    for c, ids, trained in ((a, ids_a, trained_a), (b, ids_b, trained_b)):
        got_ids, got_mask = tok.render_conversation(c)
        assert got_ids == ids and got_mask == [int(k in trained) for k in range(len(ids))]
    seq_len = len(ids_a) + len(ids_b) + 3   # room for both and 4 padding tokens
    x, y = next(ChatLoader([a, b], tok, 1, seq_len, mask="assistant", fill="pad", buffer_size=2, loop=False))
    row = ids_a + ids_b + [tok.bos_token_id] * 4   # best fit takes the longer conversation first
    trained = trained_a | {len(ids_a) + k for k in trained_b}
    assert x[0].tolist() == row[:-1]
    assert y[0].tolist() == [row[t + 1] if t + 1 in trained else -1 for t in range(seq_len)]


def test_mid_crop_row_fills_every_position_with_the_next_token(tiny_tokenizer):
    """mask "all" + fill "crop": no padding; every target is the next token of the row, the last
    conversation cropped to the row's end."""
    tok = tiny_tokenizer
    convs = [conv("first question", "first answer"), conv("second question here", "a longer second answer")]
    lens = [len(tok.render_conversation(c)[0]) for c in convs]
    seq_len = max(lens) + 3   # the shorter one cannot fit after the longer: it is cropped into the rest
    x, y = next(ChatLoader(convs, tok, 1, seq_len, mask="all", fill="crop", buffer_size=2, loop=False))
    longest, other = sorted(convs, key=lambda c: -len(tok.render_conversation(c)[0]))
    row = (tok.render_conversation(longest)[0] + tok.render_conversation(other)[0])[:seq_len + 1]
    assert x[0].tolist() == row[:-1] and y[0].tolist() == row[1:]


def test_the_prompt_at_inference_is_the_training_rendering_prefix(tiny_tokenizer):
    """A system message and a multi-turn history with a tool call: the engine's prompt
    (render_for_completion, as chat_cli builds it) and the server's (chat_api's normalisation and
    tool-call parsing of the streamed text) are the training rendering up to the reply."""
    from nanochat.chat_api import ServerSettings, parse_chat_request, prompt_messages

    tok = tiny_tokenizer
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": TOOL_REPLY}, {"role": "user", "content": "again"}]
    train = {"messages": history + [{"role": "assistant", "content": "yes"}]}
    ids, mask = tok.render_conversation(train)
    reply = ids.index(tok.encode_special("<|assistant_start|>"), len(ids) - 4) + 1
    assert tok.render_for_completion({"messages": history}) == ids[:reply]
    assert tok.render_for_completion(train) == ids[:reply]
    body = {"messages": history[:2] + [{"role": "assistant", "content": "ok <<1+2=3>> done"}] + history[3:]}
    req = parse_chat_request(body, ServerSettings())
    assert tok.render_for_completion({"messages": prompt_messages(req.messages)}) == ids[:reply]
    assert mask[reply:] == [1] * (len(ids) - reply) and not mask[reply - 1]


def test_truncated_counts_packed_conversations_not_the_read_ahead_buffer(tiny_tokenizer):
    """conversations_truncated (the run summary) said how many conversations longer than a row had
    been read into the buffer: after one row that trained one of them it already counted both (the
    other had trained nothing yet); a resumed loader counts the rest when it packs them."""
    tok = tiny_tokenizer
    seq_len = 24
    long = [conv(f"q{i}", "and so it goes on " * 10) for i in range(2)]
    short = [conv(f"s{i}", f"a{i}") for i in range(3)]
    assert all(len(tok.render_conversation(c, 10**6)[0]) > seq_len + 1 for c in long)
    for mask, fill in (("assistant", "pad"), ("all", "crop")):
        loader = ChatLoader(long + short, tok, 1, seq_len, mask=mask, fill=fill, buffer_size=5, loop=False)
        next(loader)   # the row holds one long conversation (best fit); the other waits in the buffer
        assert loader.truncated == 1 and loader.state_dict()["truncated"] == 1
        assert [len(entry[1]) for entry in loader.buffer].count(seq_len + 1) == 1   # the other long one
        rest = ChatLoader(long + short, tok, 1, seq_len, mask=mask, fill=fill, buffer_size=5, loop=False)
        rest.load_state_dict(loader.state_dict())
        list(rest)
        list(loader)
        assert rest.truncated == loader.truncated == 2


def test_a_state_saved_before_packed_counting_is_not_counted_twice(tiny_tokenizer):
    """A loader state written before the count moved to packing already counted its buffered long
    conversations; resumed, they were counted again when packed."""
    tok, seq_len = tiny_tokenizer, 24
    long = [conv(f"q{i}", "and so it goes on " * 10) for i in range(2)]
    data = long + [conv(f"s{i}", f"a{i}") for i in range(3)]
    loader = ChatLoader(data, tok, 1, seq_len, mask="all", fill="crop", buffer_size=5, loop=False)
    next(loader)
    old = dict(loader.state_dict(), truncated=2)   # the old rule: both long ones counted when read
    del old["truncated_when"]
    rest = ChatLoader(data, tok, 1, seq_len, mask="all", fill="crop", buffer_size=5, loop=False)
    rest.load_state_dict(old)
    list(rest)
    assert rest.truncated == 2


def test_extra_file_warning_names_the_line_after_a_byte_order_mark(tiny_tokenizer, tmp_path, capsys):
    """A file whose first line is only a byte-order mark (an editor's), then a conversation whose
    prompt fills the row: its reader skips the BOM line, and the warning named line 1 (the BOM),
    not line 2 (the conversation)."""
    from nanochat.tasks import ConversationFile, TaskMixture

    seq_len = 24
    rows = [conv("tell me " * 30, "no room"), conv("hi", "hello")]
    path = tmp_path / "mine.jsonl"
    path.write_text("\ufeff\n" + "\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    train = TaskMixture([ConversationFile(path)], seed=1)
    said = check_replies_fit(train, TaskMixture([ConversationFile(path)], seed=1), tiny_tokenizer, seq_len)
    warning = [s for s in said if "--extra-conversations" in s]
    assert len(warning) == 1 and warning[0].startswith(f"WARNING: --extra-conversations {path}:2: ")


@pytest.mark.parametrize("seq_len", [7, 19, 40])
def test_every_sft_target_is_its_conversations_next_assistant_token(tiny_tokenizer, seq_len):
    """Many packed rows (system messages, multi-turn, tool calls, prompts past the row): each
    conversation's rendering, found in the row by its <|bos|><|user_start|>, gives every target
    of its span (-1 off the mask), and the padding after the last one is all -1."""
    tok = tiny_tokenizer
    bos, user_start = tok.bos_token_id, tok.encode_special("<|user_start|>")
    convs = []
    for i in range(24):
        turns = [{"role": "user", "content": "word " * (i % 7)},
                 {"role": "assistant", "content": TOOL_REPLY if i % 3 == 0 else "reply " * (i % 5)}]
        c = {"messages": ([{"role": "system", "content": f"sys {i}"}] if i % 4 == 0 else []) + turns * (1 + i % 2)}
        convs.append(c)
    loader = ChatLoader(convs, tok, 2, seq_len, mask="assistant", fill="pad", buffer_size=4, loop=False)
    rendered = [tok.render_conversation(c, 10**6) for c in convs]
    for x, y in loader:
        for r in range(x.shape[0]):
            ids, tg = x[r].tolist(), y[r].tolist()
            starts = [k for k in range(seq_len - 1) if ids[k] == bos and ids[k + 1] == user_start]
            for a, b in zip(starts, starts[1:] + [seq_len]):
                span = ids[a:b]
                # the conversation this span renders (several may share a prefix: the targets decide)
                fits = [(cids, cmask) for cids, cmask in rendered if cids[:len(span)] == span[:len(cids)]
                        and all(tg[a + k] == (cids[k + 1] if cmask[k + 1] else -1)
                                for k in range(min(len(cids), seq_len + 1 - a) - 1))]
                assert fits, (seq_len, a)
                n = min(len(fits[0][0]), seq_len + 1 - a)
                assert all(t == -1 for t in tg[a + n - 1:b])   # padding after it
