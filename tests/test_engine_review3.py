"""Third review of CPU inference: generate_batch and the sampling checks refuse bad arguments with a
ValueError naming them (not a TypeError / OverflowError from deeper code), and the calculator tool's
state machine on nested and never-closed tool blocks."""

import pytest

from nanochat.engine import Engine, validate_sampling
from tests.test_engine import chat_model, run, scripted_engine, specials, tok  # noqa: F401  (fixtures)
from tests.test_engine_review2 import windowed_model


@pytest.mark.parametrize("num_samples", ["2", 2.0, None])
def test_generate_batch_names_a_bad_num_samples(num_samples):
    """generate_batch built its per-sample lists from num_samples before generate checked it: "2",
    2.0 or None raised "TypeError: ... cannot be interpreted as an integer"."""
    engine = Engine(windowed_model(), None)
    with pytest.raises(ValueError, match=r"^num_samples: got .*; accepted: an integer >= 1"):
        engine.generate_batch([1, 2, 3], num_samples=num_samples, max_tokens=2)
    results, masks = engine.generate_batch([1, 2, 3], num_samples=2, max_tokens=2, temperature=0.0)
    assert [len(r) for r in results] == [5, 5] and masks[0] == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("args, name", [((10**400, None, None), "temperature"),
                                        ((1.0, None, 10**400), "top_p"),
                                        ((1.0, None, -10**400), "top_p")])
def test_sampling_values_past_float_range_are_value_errors(args, name):
    """An int past float's range compared as finite and then float() raised OverflowError."""
    with pytest.raises(ValueError, match=f"^{name}: got"):
        validate_sampling(*args)
    engine = Engine(windowed_model(), None)
    temperature, top_k, top_p = args
    with pytest.raises(ValueError, match=f"^{name}: got"):
        engine.generate([1, 2], temperature=temperature, top_k=top_k, top_p=top_p)


def test_nested_and_unclosed_tool_blocks(tok):  # noqa: F811  (the imported fixture)
    """A second <|python_start|> inside a block starts the expression over (the inner call is the one
    evaluated, once); a block the reply never closes forces nothing and ends at the stop token."""
    s, prompt = specials(tok), [tok.bos_token_id, 3]
    script = [s.python_start, *tok.encode("1+"), s.python_start, *tok.encode("2*3"), s.python_end,
              s.python_end]
    tail = [*tok.encode(" ok"), s.python_start, *tok.encode("4*"), s.assistant_end]

    def plan(b, gen):
        if s.output_end in gen:
            return tail[len(gen) - gen.index(s.output_end) - 1]
        return script[len(gen)] if len(gen) < len(script) else 7

    forced = [s.output_start, *tok.encode("6"), s.output_end]
    for decode in ("eager", "static"):
        cols, masks = run(scripted_engine(tok, plan, prompt, decode), prompt, max_tokens=80)
        call = script[:-1]   # the forced output starts right after the first python_end
        assert [c[0] for c in cols] == call + forced + tail
        assert [m[0] for m in masks] == [1] * len(call) + [0] * len(forced) + [1] * len(tail)
