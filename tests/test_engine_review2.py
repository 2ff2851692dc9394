"""Second review of generation as chat_cli / chat_web / eval use it: KV-cache decoding against full
recomputation up to the context end with sliding-window layers (every decode mode, small buckets),
sampled decoding reproducible across decode modes, and chat_cli's handling of a terminal whose
encoding is not UTF-8 and of a -p prompt that is not UTF-8 text."""

import io

import pytest
import torch

from nanochat.engine import Engine
from nanochat.gpt import GPT, GPTConfig
from tests.test_engine import tiny_chat_model


def windowed_model(seq_len=32, pattern="SSL", n_layer=3, vocab=97):
    """A random depth-3 GPT whose first two layers attend over a window of seq_len // 4 tokens."""
    cfg = GPTConfig(sequence_len=seq_len, vocab_size=vocab, n_layer=n_layer, n_head=2, n_kv_head=1, n_embd=32,
                    window_pattern=pattern)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:   # decisive logits: greedy choices are not near-ties
                p.copy_(torch.randn(p.shape, generator=gen) * 3 / p.shape[-1] ** 0.5)
    return model.eval()


def greedy_without_cache(model, prompt, n):
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            ids.append(out[-1])
    return out


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_cached_decoding_equals_recomputation_to_the_context_end_with_windows(decode):
    """Prompts shorter than, equal to and past the window, up to one token short of the context:
    the reply fills the context exactly and every token equals the no-cache argmax."""
    model = windowed_model()
    assert model.windows[:2] == [8, 8] and model.windows[2] is None
    engine = Engine(model, None, decode=decode, decode_bucket=5)   # buckets not dividing the context
    for length in (1, 8, 9, 20, 31):
        prompt = [(i * 7 + 3) % 97 for i in range(length)]
        got = [column for column, _ in engine.generate(prompt, max_tokens=10_000, temperature=0.0, num_samples=2)]
        assert len(got) == 32 - length
        assert all(a == b for a, b in got)
        assert [a for a, _ in got] == greedy_without_cache(model, prompt, 32 - length)


def test_sampled_decoding_is_the_same_in_every_mode_and_reproducible():
    """One seed, one sequence: eager, static and a rerun agree row for row, with top-k and top-p
    on; the 'off' values (top_k >= vocab, top_k 0, top_p 1) draw exactly what no filter draws."""
    model = windowed_model()
    eager, static = Engine(model, None), Engine(model, None, decode="static", decode_bucket=8)

    def draw(engine, **kw):
        return [c for c, _ in engine.generate([3, 5, 7], num_samples=3, max_tokens=20, seed=11, **kw)]
    for kw in (dict(temperature=0.9), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.6)):
        first = draw(eager, **kw)
        assert first == draw(eager, **kw) == draw(static, **kw)
        assert len({tuple(c) for c in first}) > 1   # really sampled: the rows differ
    plain = draw(eager, temperature=1.0)
    for off in (dict(top_k=97), dict(top_k=10**6), dict(top_k=0), dict(top_p=1.0), dict(top_p=1)):
        assert draw(eager, temperature=1.0, **off) == plain, off


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


def test_chat_cli_answers_on_a_terminal_that_is_not_utf8(sft_checkpoint, monkeypatch):
    """stdout in ASCII or Latin-1 (LC_ALL=C, a Latin-1 locale, an old Windows console): a reply holding
    a character the encoding lacks (the tiny model's greedy answer starts with U+FFFD) ended -p with a
    UnicodeEncodeError traceback, and in the chat it was caught as a ValueError, so every reply was
    replaced by an error line and dropped from the history. Such characters now print as '?'."""
    from scripts import chat_cli

    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii", write_through=True)
    monkeypatch.setattr("sys.stdout", out)
    assert chat_cli.main(["-p", "Hello there, how are you?", "--device", "cpu", "-t", "0", "-m", "12"]) == 0
    text = raw.getvalue().decode("ascii")
    assert "?" in text and len(text.strip()) > 3


def test_chat_cli_refuses_a_prompt_that_is_not_utf8():
    """`-p $'caf\\xe9'` in a UTF-8 locale: the argument arrives with a lone surrogate, and the
    tokenizer silently turned it into U+FFFD; the interactive chat already refuses such a line."""
    from scripts import chat_cli

    with pytest.raises(ValueError, match=r"^-p/--prompt: got 'caf\\udce9'; accepted: UTF-8 text"):
        chat_cli.parse_args(["-p", "caf\udce9", "--device", "cpu"])


@pytest.mark.parametrize("temperature", ["-1", "nan", "inf"])
def test_chat_cli_top_p_zero_does_not_hide_a_bad_temperature(temperature):
    """--top-p 0 means greedy, and the greedy rewrite set the temperature to 0 before it was checked,
    so `--temperature -1 --top-p 0` (or nan) was accepted silently; the server checks it first too."""
    from scripts import chat_cli

    with pytest.raises(ValueError, match=r"^--temperature: got .*; accepted: a finite number >= 0"):
        chat_cli.parse_args(["-p", "hi", "--temperature", temperature, "--top-p", "0"])
    args = chat_cli.parse_args(["-p", "hi", "--temperature", "0.8", "--top-p", "0"])
    assert (args.temperature, args.top_p) == (0.0, None)   # still greedy
