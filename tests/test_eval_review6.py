"""Evaluation review 6: scoring checked against hand-computed expectations.

Defects fixed (each test below failed before its fix):
* ARC / MMLU letters (tasks/arc.py extract_letter): a hedge naming two choices ("A or B", "A, B",
  "The answer is A or B") scored as its first letter; "The answer is: B", "ANSWER IS B", "Answer: (d)",
  "answer: b" and "The answer is C!" named no answer.
* GSM8K (tasks/gsm8k.py extract_answer): "#### 12/5" was read as 12 and "#### 1e3" as 1, so a
  fraction or exponent whose head equals the gold number passed.
* chat_eval --seed -1 (or a seed near 2**64) passed validation and stopped the run at the first
  generative task, after the model had loaded and the categorical tasks had run.
* SpellingBee's missing word list said where it looked but not how to make one (no hub copy exists).
The rest guard behaviour asked for by the review: HumanEval programs that exit, raise SystemExit,
read stdin, print or time out; calculator output inside GSM8K answers; CORE / ChatCORE centring;
greedy scores independent of --seed and --batch-size; local files before the hub.
"""

from __future__ import annotations

import json

import pytest
import torch

from nanochat.tasks.arc import evaluate_letter, mc_conversation


def mc(gold: str) -> dict:
    return mc_conversation("Sky colour?", ["green", "blue", "red", "black"], "ABCD".index(gold))


# ------------------------------------------------------------------ multiple-choice letters

@pytest.mark.parametrize("completion", ["A or B", "A, B", "A/B", "(A) and (B)", "a or b", "**A** or **B**",
                                        "The answer is A or B", "Answer: A, B"])
def test_a_hedge_between_two_letters_is_no_answer(completion):
    assert not evaluate_letter(mc("A"), completion) and not evaluate_letter(mc("B"), completion)


@pytest.mark.parametrize("completion, gold", [
    ("The answer is: B", "B"), ("ANSWER IS B", "B"), ("Answer: (d)", "D"), ("answer: b", "B"),
    ("My answer is c.", "C"), ("The answer is C!", "C"), ("Final answer: **(A)**", "A"),
    ("A, because the sky scatters red", "A"), ("The answer is D, not A", "D"), ("A, A", "A"),
])
def test_named_and_lower_case_letters_are_read(completion, gold):
    assert evaluate_letter(mc(gold), completion)
    wrong = "A" if gold != "A" else "B"
    assert not evaluate_letter(mc(wrong), completion)


@pytest.mark.parametrize("completion", ["The answer is a bird", "I think B", "Answer: Because", "Optional C"])
def test_text_that_names_no_letter_scores_nothing(completion):
    assert not any(evaluate_letter(mc(g), completion) for g in "ABCD")


# ------------------------------------------------------------------ GSM8K final answers

@pytest.mark.parametrize("text, number", [
    ("#### 1,234", "1234"), ("#### -5", "-5"), ("#### -$1,234.50", "-1234.50"), ("#### 3.50", "3.5"),
    ("#### 18 dollars", "18"), ("#### 18.", "18"), ("#### 18, done", "18"), ("#### 25%", "25"),
    ("work...\n#### 7\n#### 8", "7"), ("#### .5 km", "0.5"),
])
def test_gsm8k_final_answers(text, number):
    from nanochat.tasks.gsm8k import GSM8K

    assert GSM8K.__new__(GSM8K).evaluate({"answer": number}, text)


@pytest.mark.parametrize("text, head", [("#### 12/5", "12"), ("#### 12 / 5", "12"), ("#### 1e3", "1"),
                                        ("#### 1,234/5", "1"), ("#### 2.5/3", "2"), ("#### 7E+2", "7")])
def test_a_fraction_or_exponent_is_not_its_head(text, head):
    from nanochat.tasks.gsm8k import GSM8K, extract_answer

    assert extract_answer(text) is None
    assert not GSM8K.__new__(GSM8K).evaluate({"answer": head}, text)


class Scripted:
    """An Engine stand-in: answers problem i with script[i] (token ids); checks the seed range as
    Engine.check_request does, and records the seeds it got."""

    max_seq_len = 4096

    def __init__(self, script):
        from nanochat.sampling import MAX_SEED

        self.script, self.calls, self.max_seed = script, [], MAX_SEED

    def generate_batch(self, prompt, *, num_samples, max_tokens, temperature, top_k, seed):
        if not 0 <= seed <= self.max_seed:
            raise ValueError(f"seed: got {seed}; accepted: an integer in 0..{self.max_seed}")
        self.calls.append(seed)
        return [list(prompt) + self.script[len(self.calls) - 1]] * num_samples, None


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def gsm_dir(tmp_path):
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
            for a, b in ((3, 4), (1000, 234), (2, 2))]
    write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    return tmp_path


def tool_call(tok, expr: str, out: str) -> list[int]:
    sp = tok.encode_special
    return ([sp("<|python_start|>")] + tok.encode(expr) + [sp("<|python_end|>"), sp("<|output_start|>")]
            + tok.encode(out) + [sp("<|output_end|>")])


def test_gsm8k_answers_with_calculator_output_in_them(tiny_tokenizer, gsm_dir):
    from nanochat.tasks import GSM8K
    from nanochat.tasks.evaluate import run_generative

    tok = tiny_tokenizer
    script = [tok.encode("3 + 4 = ") + tool_call(tok, "3+4", "7") + tok.encode("7.\n#### 7"),
              tok.encode("1000 + 234 = ") + tool_call(tok, "1000+234", "1234") + tok.encode("\n#### ")
              + tool_call(tok, "1000+234", "1234"),   # the final number is the calculator's output
              tok.encode("#### ") + tool_call(tok, "2*2", "4") + tok.encode("5")]   # "#### 45": wrong
    res = run_generative(Scripted(script), tok, GSM8K(data_dir=gsm_dir), "cpu", max_new_tokens=8)
    assert (res.passed, res.total) == (2, 3)


def test_chat_eval_refuses_a_seed_the_sampler_cannot_take():
    from nanochat.sampling import MAX_SEED
    from scripts.chat_eval import parse_args

    for seed in (-1, MAX_SEED + 1):
        with pytest.raises(ValueError, match=rf"--seed: got {seed}; accepted: an integer in 0\.\.{MAX_SEED}"):
            parse_args(["-i", "sft", "--seed", str(seed)])
    assert parse_args(["-i", "sft", "--seed", "0"]).seed == 0


def test_generative_seeds_wrap_into_the_samplers_range(tiny_tokenizer, gsm_dir):
    from nanochat.sampling import MAX_SEED
    from nanochat.tasks import GSM8K
    from nanochat.tasks.evaluate import run_generative

    engine = Scripted([tiny_tokenizer.encode("#### 7")] * 3)
    res = run_generative(engine, tiny_tokenizer, GSM8K(data_dir=gsm_dir), "cpu", seed=MAX_SEED - 1)
    assert engine.calls == [MAX_SEED - 1, MAX_SEED, 0] and (res.passed, res.total) == (1, 3)


# ------------------------------------------------------------------ HumanEval pass@1

def test_humaneval_pass_at_1_over_programs_that_exit_print_block_or_hang(tiny_tokenizer, tmp_path):
    from nanochat.tasks import HumanEval
    from nanochat.tasks.evaluate import run_generative

    row = {"task_id": "t/0", "prompt": 'def add(a, b):\n    """a + b"""\n', "canonical_solution": "    return a + b\n",
           "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"}
    write_jsonl(tmp_path / "humaneval.jsonl", [dict(row, task_id=f"t/{i}") for i in range(6)])
    bodies = ["    print('working...')\n    return a + b\n",          # passes: output is not the verdict
              "    return a + b\nexit(0)\n",                          # ends before check(): not a pass
              "    raise SystemExit(0)\n",
              "    return a + b\nimport sys\nsys.exit()\n",
              "    input()\n    return a + b\n",                         # stdin is closed
              "    while True:\n        pass\n"]                         # killed at the time limit
    he = HumanEval(data_dir=tmp_path, timeout_s=1.0)
    res = run_generative(Scripted([tiny_tokenizer.encode(b) for b in bodies]), tiny_tokenizer, he, "cpu")
    assert (res.passed, res.total, res.pass_at(1)) == (1, 6, pytest.approx(1 / 6))


# ------------------------------------------------------------------ CORE / ChatCORE centring

def test_core_and_chatcore_centre_each_task_then_average():
    from nanochat.core_eval import centered_accuracy, core_metric
    from nanochat.tasks import EVAL_TASKS
    from nanochat.tasks.evaluate import chatcore

    # (acc - b) / (1 - b): 0.5 at b 0.25 -> 1/3; 0.75 at b 0.5 -> 0.5; 0.3 at b 0 -> 0.3; 0.1 at 0.25 -> -0.2
    centered = {"a": centered_accuracy(0.5, 0.25), "b": centered_accuracy(0.75, 0.5), "c": centered_accuracy(0.3, 0.0),
                "d": centered_accuracy(0.1, 0.25)}
    assert list(centered.values()) == pytest.approx([1 / 3, 0.5, 0.3, -0.2])
    assert core_metric(centered) == pytest.approx((1 / 3 + 0.5 + 0.3 - 0.2) / 4)
    baselines = {n: b for n, (_, b) in EVAL_TASKS.items()}
    accs = {"ARC-Easy": 0.5, "MMLU": 0.25, "GSM8K": 0.1, "HumanEval": 0.0}
    assert chatcore(accs, baselines) == pytest.approx((1 / 3 + 0 + 0.1 + 0) / 4)
    with pytest.raises(ValueError, match="random_baseline"):
        centered_accuracy(0.5, 25)   # a percentage is refused, not centred to garbage


def test_bundle_baselines_are_percentages_centred_as_fractions(tmp_path):
    from nanochat.core_data import load_core_data
    from nanochat.core_eval import centered_accuracy

    (tmp_path / "core.yaml").write_text("icl_tasks:\n- label: tiny_mc\n  dataset_uri: t/mc.jsonl\n"
                                        "  num_fewshot: [0]\n  icl_task_type: multiple_choice\n")
    (tmp_path / "eval_meta_data.csv").write_text("Eval Task,Random baseline\ntiny_mc,9.1\n")
    (tmp_path / "eval_data" / "t").mkdir(parents=True)
    write_jsonl(tmp_path / "eval_data" / "t" / "mc.jsonl", [{"query": "q", "choices": ["x", "y"], "gold": 0}] * 2)
    (task, _), = load_core_data(tasks=["tiny_mc"], bundle_dir=tmp_path).tasks
    assert task.random_baseline == pytest.approx(0.091)
    assert centered_accuracy(0.5, task.random_baseline) == pytest.approx((0.5 - 0.091) / 0.909)


# ------------------------------------------------------------------ greedy results: seed and batch size

def test_greedy_results_do_not_depend_on_seed_or_batch_size(tiny_tokenizer, shared_data, gsm_dir):
    from nanochat.engine import Engine
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tasks import ARC, GSM8K
    from nanochat.tasks.evaluate import run_categorical, run_generative

    cfg = GPTConfig(sequence_len=512, vocab_size=tiny_tokenizer.vocab_size, n_layer=1, n_head=2, n_kv_head=2,
                    n_embd=32, window_pattern="L")
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights()
    with torch.no_grad():   # init_weights zeroes the head: every letter would tie
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.eval()
    arc = ARC("easy", data_dir=shared_data, stop=12)
    scores = {bs: run_categorical(model, tiny_tokenizer, arc, "cpu", batch_size=bs).passed for bs in (1, 5, 12)}
    assert len(set(scores.values())) == 1, scores
    engine, gsm = Engine(model, tiny_tokenizer), GSM8K(data_dir=gsm_dir, stop=1)
    texts = []
    for seed in (0, 1234):
        log = []
        run_generative(engine, tiny_tokenizer, gsm, "cpu", max_new_tokens=8, seed=seed, log=log.append)
        texts.append(log)
    assert texts[0] == texts[1] and texts[0]


# ------------------------------------------------------------------ data: local first, then the hub

def test_a_local_file_is_used_without_touching_the_hub(gsm_dir, monkeypatch):
    from nanochat.tasks import GSM8K, common

    monkeypatch.setattr(common, "load_hub_rows", lambda *a: pytest.fail("the hub was asked"))
    assert GSM8K(data_dir=gsm_dir).source == str(gsm_dir / "gsm8k.jsonl")


def test_a_missing_word_list_says_how_to_make_one(tmp_path):
    from nanochat.tasks import DataUnavailableError, SpellingBee

    with pytest.raises(DataUnavailableError) as e:
        SpellingBee(data_dir=tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "words.txt") in msg and "one lowercase a-z word per line" in msg, msg


@pytest.mark.parametrize("script", ["chat_eval", "base_eval", "chat_rl", "chat_sft"])
def test_a_step_that_is_a_unicode_digit_is_refused_by_flag(script, tmp_path, monkeypatch):
    """`--step ²` passed str.isdigit() and failed later at int() (a traceback naming no flag)."""
    import importlib

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    module = importlib.import_module(f"scripts.{script}")
    with pytest.raises(ValueError, match=r"--step: got '²'"):
        module.main(["--device", "cpu", "--step", "²"] + (["-i", "sft"] if script == "chat_eval" else []))


def test_the_last_named_answer_counts():
    """With lower-case letters read after "answer:", an earlier "To answer: a, b and c ..." was taken
    (or made a hedge) over the final "The answer is B"."""
    from nanochat.tasks.arc import extract_letter
    assert extract_letter("To answer: a, b and c are animals. The answer is B", "ABCD") == "B"
    assert extract_letter("Answer: C. On reflection, the answer is D.", "ABCD") == "D"
    assert extract_letter("The answer is A or B", "ABCD") is None
