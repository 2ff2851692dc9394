"""scripts/chat_cli.py as a demanding terminal user meets it (review 10): -i base continues plain
text (a pretrained model never saw the chat template), and an unseeded sampled answer differs from
one session to the next (init_runtime seeds `random`, which drew the same "new" seed every run)."""

from dataclasses import asdict

import pytest

from nanochat.engine import Engine
from tests.test_engine import tiny_chat_model

FLAGS = ["--device", "cpu", "-m", "4"]


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's


@pytest.fixture
def base_checkpoint(chat_model, sft_checkpoint):
    """The tiny model saved as a base checkpoint too, beside conftest's sft one."""
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint

    model, tokenizer = chat_model
    save_checkpoint(checkpoint_dir("base", "d2", sft_checkpoint), 7, model_state=model.state_dict(),
                    meta={"model_config": asdict(model.config), "tokenizer_fingerprint": tokenizer.fingerprint})
    return sft_checkpoint


@pytest.fixture
def requests(monkeypatch):
    """Each Engine.generate call's prompt tokens, stop tokens and seed (the real generation runs)."""
    seen = []
    real = Engine.generate

    def recorded(self, tokens, **kw):
        seen.append({"prompt": list(tokens), "stops": set(kw["stop_tokens"]), "seed": kw["seed"]})
        return real(self, tokens, **kw)
    monkeypatch.setattr(Engine, "generate", recorded)
    return seen


def test_base_source_continues_plain_text(base_checkpoint, chat_model, requests, monkeypatch, capsys):
    """-i base wrapped the text in <|user_start|> ... <|assistant_start|>, special tokens a base model never
    learned, and waited for an <|assistant_end|> it never writes: now <|bos|> + the text, ended by <|bos|>,
    each interactive line on its own (no history in a template it does not know)."""
    from scripts import chat_cli

    tok = chat_model[1]
    assert chat_cli.main(["-i", "base", "-p", "The capital of France is", "-t", "0", *FLAGS]) == 0
    assert requests[0]["prompt"] == tok.encode("The capital of France is", prepend="<|bos|>")
    assert requests[0]["stops"] == {tok.bos_token_id}
    lines = iter(["To be or not", "to be"])

    def typed(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", typed)
    assert chat_cli.main(["-i", "base", "-t", "0", *FLAGS]) == 0
    assert [r["prompt"] for r in requests[1:]] == [tok.encode(t, prepend="<|bos|>") for t in ("To be or not", "to be")]
    assert "no chat template, no history" in capsys.readouterr().out
    with pytest.raises(ValueError, match="^the text is [0-9]+ tokens, the model's context is 256: shorten -p$"):
        chat_cli.main(["-i", "base", "-p", "ab " * 300, *FLAGS])
    # the chat phases keep their template
    assert chat_cli.main(["-p", "The capital of France is", "-t", "0", *FLAGS]) == 0
    assert requests[-1]["prompt"] == tok.render_for_completion(
        {"messages": [{"role": "user", "content": "The capital of France is"}]})


def test_unseeded_answers_draw_a_new_seed_each_session(sft_checkpoint, requests, capsys):
    """Without --seed ("a new one per answer") two runs of `chat_cli -p hi -t 1` printed the same answer:
    init_runtime seeds `random` with 42, from which the seed was drawn."""
    from scripts import chat_cli

    for _ in range(2):
        assert chat_cli.main(["-p", "hi", "-t", "1", *FLAGS]) == 0
    assert requests[0]["seed"] != requests[1]["seed"]
    capsys.readouterr()
    outs = []
    for _ in range(2):
        assert chat_cli.main(["-p", "hi", "-t", "1", "--seed", "5", *FLAGS]) == 0
        outs.append(capsys.readouterr().out)
    assert requests[2]["seed"] == requests[3]["seed"] == 5 and outs[0] == outs[1]   # --seed: the same answer
