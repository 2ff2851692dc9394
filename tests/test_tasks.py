"""Tasks: rendering (with the tokenizer's loss masks), GSM8K tool calls and answers, HumanEval
scoring through the sandbox, generated tasks, mixtures, loader errors, the eval loops, chat_eval flags."""

import json
import re

import pytest
import torch

from nanochat.tasks import (ARC, EVAL_TASKS, GSM8K, MMLU, DataUnavailableError, HumanEval,
                            IdentityConversations, LocalConversations, SimpleSpelling, SpellingBee, TaskMixture,
                            TaskSequence, get_conversations, get_task)
from nanochat.tasks import common as tasks_common
from nanochat.tasks.evaluate import chatcore, run_categorical, run_generative
from nanochat.tasks.gsm8k import extract_answer, solution_to_parts
from nanochat.tasks.humaneval import extract_program


@pytest.fixture(autouse=True)
def _isolated_base(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    for var in ("NANOCHAT_EVAL_DIR", "NANOCHAT_SFT_DIR"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def tok(shared_data):
    tokenizer = pytest.importorskip("nanochat.tokenizer")
    rows = [json.loads(line) for line in open(shared_data / "eval" / "gsm8k.jsonl")][:300]
    return tokenizer.Tokenizer.train([r["question"] + "\n" + r["answer"] for r in rows], 600)


def test_multiple_choice_tasks(shared_data):
    arc = ARC("challenge", data_dir=shared_data)
    assert len(arc) == 1172 and arc.eval_type == "categorical"
    conv = arc[0]
    user, answer = conv["messages"][0]["content"], conv["messages"][1]["content"]
    assert conv["letters"] == ["A", "B", "C", "D"] and answer == "C"
    assert "\nA. Planetary density will decrease." in user and "\nD. " in user
    assert arc.evaluate(conv, " C") and arc.evaluate(conv, "c.") and not arc.evaluate(conv, "A")
    mmlu = MMLU(subject="astronomy", data_dir=shared_data)
    assert 0 < len(mmlu) < 1000 and mmlu[0]["subject"] == "astronomy"
    assert mmlu[0]["messages"][0]["content"].startswith("(astronomy)")
    with pytest.raises(ValueError, match="subset"):
        ARC("medium")
    with pytest.raises(ValueError, match="MMLU split"):
        MMLU("train")


def test_gsm8k_tool_calls_and_answers(shared_data):
    parts = solution_to_parts("She makes 9 * 2 = $<<9*2=18>>18 a day.\n#### 18")
    assert parts == [{"type": "text", "text": "She makes 9 * 2 = $"}, {"type": "python", "text": "9*2"},
                     {"type": "python_output", "text": "18"}, {"type": "text", "text": "18 a day.\n#### 18"}]
    assert solution_to_parts("odd <<oops>> text")[0]["text"] == "odd <<oops>> text"  # no '=': kept as text
    assert extract_answer("so #### 1,234") == "1234" and extract_answer("#### -7.5.") == "-7.5"
    assert extract_answer("#### 3 then #### 4") == "3" and extract_answer("no marker 5") is None
    gsm = GSM8K(data_dir=shared_data)
    conv = gsm[0]
    kinds = [p["type"] for p in conv["messages"][1]["content"]]
    assert kinds.count("python") == kinds.count("python_output") == 2 and conv["answer"] == "18"
    assert gsm.evaluate(conv, "the answer\n#### 18") and gsm.evaluate(conv, "#### 18.0")
    assert not gsm.evaluate(conv, "#### 17") and not gsm.evaluate(conv, "18")
    assert gsm.reward(conv, "#### 18") == 1.0
    n_calls = sum(sum(p["type"] == "python" for p in gsm[i]["messages"][1]["content"]) for i in range(50))
    assert n_calls > 50  # most solutions call the calculator


def test_gsm8k_answers_compare_exactly():
    from nanochat.tasks.gsm8k import answers_match
    assert answers_match("18", "18.0") and answers_match("-7.50", "-7.5") and answers_match("1234", "1234")
    # a float tolerance (or float rounding) used to accept near misses
    assert not answers_match("123456789012345679", "123456789012345678")
    assert not answers_match("0.1000001", "0.1") and not answers_match(None, "1")


def test_gsm8k_tool_output_is_what_the_engine_forces(shared_data):
    # Training must render the tool output the Engine forces at inference (use_calculator's text),
    # not the annotation's spelling of it: 155 of the 4,282 test-split calls write "16.00" where
    # the calculator prints "16". A refused expression keeps the annotation (nothing is forced).
    from nanochat.calculator import use_calculator
    parts = solution_to_parts("4 at $4 is 4*4 = $<<4*4=16.00>>16.00, 3/4 = <<3/4=3/4>>0.75, <<2^3=8>>8")
    outputs = [p["text"] for p in parts if p["type"] == "python_output"]
    assert outputs == ["16", "0.75", "8"] and use_calculator("2^3") is None
    gsm = GSM8K(data_dir=shared_data)
    for i in range(len(gsm)):
        content = gsm[i]["messages"][1]["content"]
        for call, out in zip(content, content[1:]):
            if call["type"] == "python" and use_calculator(call["text"]) is not None:
                assert out == {"type": "python_output", "text": use_calculator(call["text"])}, (i, call)


def test_render_conversation_masks(tok, shared_data):
    conv = GSM8K(data_dir=shared_data)[0]
    ids, mask = tok.render_conversation(conv)
    sp = {n: tok.encode_special(f"<|{n}|>") for n in ("assistant_start", "assistant_end", "python_start",
                                                       "python_end", "output_start", "output_end", "user_end")}
    assert ids[0] == tok.bos_token_id and sum(mask[: ids.index(sp["user_end"]) + 1]) == 0
    i_ps, i_pe = ids.index(sp["python_start"]), ids.index(sp["python_end"])
    i_os, i_oe = ids.index(sp["output_start"]), ids.index(sp["output_end"])
    assert all(mask[i_ps: i_pe + 1]) and not any(mask[i_os: i_oe + 1])  # tool call trained, output not
    assert tok.decode(ids[i_ps + 1: i_pe]) == "16-3-4" and tok.decode(ids[i_os + 1: i_oe]) == "9"
    assert ids[-1] == sp["assistant_end"] and mask[-1] == 1
    prompt = tok.render_for_completion(conv)
    assert prompt[-1] == sp["assistant_start"] and ids[: len(prompt)] == prompt
    for task in (SpellingBee(split="test", data_dir=shared_data), IdentityConversations(size=5),
                 ARC(data_dir=shared_data), LocalConversations(data_dir=shared_data)):
        ids, mask = tok.render_conversation(task[0])
        assert 0 < sum(mask) < len(ids)


def test_humaneval_through_the_sandbox(shared_data):
    he = HumanEval(data_dir=shared_data)
    assert len(he) == 164
    for i in (0, 2):
        conv = he.file_example(i)
        body = conv["messages"][1]["content"][len(conv["prompt"]):]
        assert he.evaluate(conv, body)  # body only: the prompt is prepended
        assert he.evaluate(conv, f"Here you go:\n```python\n{conv['messages'][1]['content']}```\nDone.")
        assert not he.evaluate(conv, "    return None\n")
    conv = he.file_example(0)
    # the doctest idiom models often end with (doctest imports pdb: it must stay importable)
    doctest_idiom = '\n\nif __name__ == "__main__":\n    import doctest\n    doctest.testmod()\n'
    assert he.evaluate(conv, f"```python\n{conv['messages'][1]['content']}{doctest_idiom}```")
    assert not he.evaluate(conv, "    import os\n    os.system('rm -rf /')\n    return True\n")
    looping = "    while True:\n        pass\n"
    fast = HumanEval(data_dir=shared_data, timeout_s=1.0)
    assert not fast.evaluate(conv, looping)
    program = extract_program("def has_close_elements(numbers, threshold):\n    return False\n", conv["prompt"],
                              "has_close_elements")
    assert program.startswith("from typing import List")  # imports kept when the model redefines


def test_humaneval_keeps_the_prompts_helpers(shared_data):
    """HumanEval/10's prompt defines is_palindrome, which make_palindrome needs: a completion that
    writes only the entry point must still see the prompt's helper (and imports)."""
    conv = HumanEval(data_dir=shared_data).file_example(10)
    assert conv["entry_point"] == "make_palindrome" and "def is_palindrome" in conv["prompt"]
    solution = conv["messages"][1]["content"][len(conv["prompt"]):]
    assert HumanEval(data_dir=shared_data).evaluate(conv, "def make_palindrome(string: str) -> str:\n" + solution)


@pytest.mark.parametrize("completion", [
    "Sure:\n```python3\ndef add(a, b):\n    return a + b\n```\nThat's it.",          # info string python3
    "Example:\n```text\n>>> add(1, 2)\n3\n```\nCode:\n```python\ndef add(a, b):\n    return a + b\n```",
    "Install:\n```bash\npip install nothing\n```\nThen:\n```\ndef add(a, b):\n    return a + b\n```",
    "```python\r\ndef add(a, b):\r\n    return a + b\r\n```\r\n",                 # CRLF line ends
    "Steps:\n1. Write it:\n   ```python\n   def add(a, b):\n       return a + b\n   ```\n",  # fence in a list
    "```python\nfrom operator import mul\n```\nand\n```python\ndef add(a, b):\n    return a + b\n```",
    "````python\ndef add(a, b):\n    fence = '```'\n    return a + b\n````",
    "```python\n    return a + b\n```",                                                  # a body, fenced
    "```python\ndef add(a, b):\n    return a + b\n",                                    # cut off, unclosed
    "    return a + b\n",                                                               # a raw body
])
def test_humaneval_extracts_the_python_block(completion):
    """The program is the prompt plus the completion's Python: never the prose or a block in another
    language (a closing fence is not an opening one), whatever the fence's label or indentation."""
    prompt = 'def add(a, b):\n    """Return a + b."""\n'
    namespace: dict = {}
    exec(compile(extract_program(completion, prompt, "add"), "program.py", "exec"), namespace)
    assert namespace["add"](2, 3) == 5


def test_spelling_bee_is_generated_deterministically(shared_data):
    train, test = SpellingBee(size=50, data_dir=shared_data), SpellingBee(size=50, split="test", data_dir=shared_data)
    again = SpellingBee(size=50, data_dir=shared_data)
    assert [train[i] for i in range(10)] == [again[i] for i in range(10)]
    assert not {train[i]["word"] for i in range(50)} & {test[i]["word"] for i in range(50)}
    for i in range(50):
        ex = train[i]
        parts = ex["messages"][1]["content"]
        assert ex["word"].count(ex["letter"]) == int(ex["answer"])
        assert parts[1] == {"type": "python", "text": f'"{ex["word"]}".count("{ex["letter"]}")'}
        assert parts[2]["text"] == ex["answer"] and train.evaluate(ex, parts[-1]["text"])
    assert SpellingBee(size=50, seed=1, data_dir=shared_data)[0] != train[0] or \
        SpellingBee(size=50, seed=1, data_dir=shared_data)[1] != train[1]


def test_simple_spelling_spells_the_word_and_keeps_the_split(shared_data):
    """SimpleSpelling answers with the word's letters in order; reproducible per seed; train and
    test words disjoint (SpellingBee's split); evaluate checks the letters."""
    train = SimpleSpelling(size=40, data_dir=shared_data)
    test = SimpleSpelling(size=40, split="test", data_dir=shared_data)
    assert [train[i] for i in range(10)] == [SimpleSpelling(size=40, data_dir=shared_data)[i] for i in range(10)]
    assert not {train[i]["word"] for i in range(40)} & {test[i]["word"] for i in range(40)}
    for i in range(40):
        ex = train[i]
        answer = ex["messages"][1]["content"]
        assert answer.split(" is spelled ")[1].rstrip(".").split(", ") == list(ex["word"])
        assert ex["word"] in ex["messages"][0]["content"].lower() and train.evaluate(ex, answer)
        assert not train.evaluate(ex, answer.replace(", ", ",", 1) if len(ex["word"]) > 1 else "nothing")
    # the spelling of a longer word that ends in this one is not this word's ("c, a, t." is not "at")
    assert train.evaluate({"word": "at"}, "at is spelled a, t.") and train.evaluate({"word": "at"}, "a, t.")
    assert not train.evaluate({"word": "at"}, "cat is spelled c, a, t.")
    with pytest.raises(ValueError, match="SimpleSpelling split"):
        SimpleSpelling(split="dev", data_dir=shared_data)


def test_identity_conversations():
    task = IdentityConversations(size=200, seed=3)
    assert [task[i] for i in range(20)] == [IdentityConversations(size=200, seed=3)[i] for i in range(20)]
    texts = [m["content"] for i in range(200) for m in task[i]["messages"]]
    assert any("nanochat-spark" in t for t in texts) and len(set(texts)) > 20
    for i in range(200):
        roles = [m["role"] for m in task[i]["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)


def test_mixture_sequence_and_slicing():
    a, b = IdentityConversations(size=30, seed=1), IdentityConversations(size=10, seed=2)
    mix = TaskMixture([a, b, b], seed=5)
    assert len(mix) == 50 and [mix[i] for i in range(50)] == [TaskMixture([a, b, b], seed=5)[i] for i in range(50)]
    assert sum(mix.task_of(i) is b for i in range(50)) == 20  # listed twice = oversampled
    assert [mix[i] for i in range(50)] != [TaskMixture([a, b, b], seed=6)[i] for i in range(50)]
    two = TaskMixture([a, b], seed=5, epochs=2)
    assert len(two) == 80 and sorted(map(str, (two[i] for i in range(40)))) == sorted(map(str, (two[i] for i in range(40, 80))))
    seq = TaskSequence([a, b])
    assert len(seq) == 40 and seq[30] == b[0] and seq[-1] == b[9]
    sliced = IdentityConversations(size=30, seed=1, start=5, stop=20, step=5)
    assert len(sliced) == 3 and sliced[1] == a[10]
    with pytest.raises(IndexError):
        sliced[3]
    with pytest.raises(ValueError, match="slice"):
        IdentityConversations(start=5, stop=2)
    with pytest.raises(ValueError, match="epochs"):
        TaskMixture([a], epochs=0)


def test_loader_error_names_local_and_hub(tmp_path, monkeypatch):
    def no_datasets():
        raise ImportError("No module named 'datasets'")

    monkeypatch.setattr(tasks_common, "_import_datasets", no_datasets)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataUnavailableError) as e:
        ARC("easy", data_dir=empty)
    msg = str(e.value)
    assert str(empty / "arc_easy_test.jsonl") in msg and "allenai/ai2_arc" in msg and "datasets" in msg
    monkeypatch.setenv("NANOCHAT_SFT_DIR", str(empty))
    with pytest.raises(DataUnavailableError, match="HuggingFaceTB/smol-smoltalk"):
        get_conversations("train")
    with pytest.raises(DataUnavailableError, match="words.txt"):
        SpellingBee(data_dir=empty)


def test_chat_eval_checks_every_task_before_the_model(tmp_path, monkeypatch):
    """A missing eval file fails before the checkpoint is loaded (none exists here) or any task runs."""
    from scripts import chat_eval

    monkeypatch.setattr(tasks_common, "_import_datasets", lambda: (_ for _ in ()).throw(ImportError("no datasets")))
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "no_checkpoints"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataUnavailableError, match="humaneval"):
        chat_eval.main(["-i", "sft", "-a", "HumanEval", "--device", "cpu", "--data-dir", str(empty)])


def test_hub_fallback_converts_rows(tmp_path, monkeypatch):
    class FakeDatasets:
        @staticmethod
        def load_dataset(name, config, split):
            assert (name, config, split) == ("allenai/ai2_arc", "ARC-Easy", "test")
            return [{"id": "x1", "question": "Sky colour?", "answerKey": "B",
                     "choices": {"text": ["green", "blue"], "label": ["A", "B"]}}]

    monkeypatch.setattr(tasks_common, "_import_datasets", lambda: FakeDatasets)
    arc = ARC("easy", data_dir=tmp_path)
    assert arc.source.startswith("hub:allenai/ai2_arc") and arc[0]["messages"][1]["content"] == "B"


def test_env_dir_override_and_local_conversations(tmp_path, monkeypatch, shared_data):
    (tmp_path / "arc_easy.jsonl").write_text(json.dumps({"id": "1", "question": "2+2?", "choices": ["4", "5"], "answer": 0}) + "\n")
    monkeypatch.setenv("NANOCHAT_EVAL_DIR", str(tmp_path))
    assert len(ARC("easy")) == 1
    train, test = LocalConversations("train", data_dir=shared_data), LocalConversations("test", data_dir=shared_data)
    assert len(train) + len(test) == 898 + 1078 and len(test) == 45 + 54
    bad = tmp_path / "sft"
    bad.mkdir()
    (bad / "x.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="x.jsonl:1"):
        LocalConversations("test", data_dir=bad)
    with pytest.raises(ValueError, match="get_conversations source: got 'web'"):
        get_conversations("train", source="web")


class LetterModel(torch.nn.Module):
    """Always puts the highest logit on one token."""

    def __init__(self, vocab_size, token):
        super().__init__()
        self.vocab_size, self.token = vocab_size, token

    def forward(self, idx, targets=None):
        logits = torch.zeros(*idx.shape, self.vocab_size)
        logits[..., self.token] = 5.0
        return logits


def test_pass_at_k_is_the_unbiased_estimator():
    from itertools import combinations
    from math import comb

    from nanochat.tasks.evaluate import pass_at_k

    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):   # the share of k-subsets of the n samples holding a correct one
                subsets = list(combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)
    assert pass_at_k(200, 3, 10) == pytest.approx(1 - comb(197, 10) / comb(200, 10), rel=1e-12)


def test_categorical_and_generative_loops(tok, shared_data):
    arc = ARC("easy", data_dir=shared_data)
    model = LetterModel(tok.vocab_size, tok.encode("B")[0])
    res = run_categorical(model, tok, arc, "cpu", batch_size=7, max_problems=40)
    golds = [arc[i]["messages"][1]["content"] for i in range(40)]
    assert res.total == 40 and res.passed == golds.count("B")

    class FakeEngine:
        max_seq_len = 4096

        def generate_batch(self, prompt, num_samples, **kw):
            answers = ["#### 17", "#### 18"]  # the second sample is right for problem 0
            return [prompt + tok.encode(answers[s % 2]) for s in range(num_samples)], None

    gsm = GSM8K(data_dir=shared_data)
    one = run_generative(FakeEngine(), tok, gsm, "cpu", num_samples=1, max_problems=1)
    lines = []
    two = run_generative(FakeEngine(), tok, gsm, "cpu", num_samples=2, max_problems=1, name="GSM8K", log=lines.append)
    assert (one.passed, two.passed) == (0, 1)  # pass@k
    # chat_eval prints a task's score line after its examples: each example names its task
    assert lines == ["  GSM8K example 0: 1/2 passed | '#### 17'"], lines
    # one sample of two right: pass@1 is 1/2 whichever sample it was (not 0 for "the first one failed")
    assert two.passed_at == (0.5, 1.0) and (two.pass_at(1), two.pass_at(2)) == (0.5, 1.0)
    with pytest.raises(ValueError, match="pass@3: the evaluation drew 2 sample"):
        two.pass_at(3)
    with pytest.raises(ValueError, match="--num-samples"):
        run_generative(FakeEngine(), tok, gsm, "cpu", num_samples=0, max_problems=1)
    assert chatcore({"ARC-Easy": 0.25, "GSM8K": 0.5}, {n: b for n, (_, b) in EVAL_TASKS.items()}) == pytest.approx(0.25)


def test_get_task_and_chat_eval_flags():
    from scripts.chat_eval import parse_args

    assert set(EVAL_TASKS) == {"ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee"}
    with pytest.raises(ValueError, match="--task-name"):
        get_task("TriviaQA")
    cfg = parse_args(["-i", "sft", "-a", "ARC-Easy|GSM8K", "--max_problems", "5", "--num-samples", "2", "-t", "0.8"])
    assert cfg.tasks() == ["ARC-Easy", "GSM8K"] and cfg.max_problems == 5 and cfg.num_samples == 2
    for argv, flag in ((["-i", "pretrain"], "--source"), (["-i", "sft", "-a", "ARC"], "--task-name"),
                       (["-i", "sft", "--temperature", "-1"], "--temperature"), (["-i", "sft", "--step", "x"], "--step"),
                       (["-i", "sft", "--decode", "fast"], "--decode")):
        with pytest.raises(ValueError, match=flag):
            parse_args(argv)


def test_chat_eval_end_to_end(tmp_path, monkeypatch, tok):
    """A depth-1 random GPT saved as an SFT checkpoint, evaluated on 2 problems of every task."""
    from dataclasses import asdict

    gpt = pytest.importorskip("nanochat.gpt")
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.tokenizer import tokenizer_dir
    from scripts import chat_eval

    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    tok.save(tokenizer_dir(base))
    cfg = gpt.GPTConfig(sequence_len=1024, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=32,
                        window_pattern="L")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    model.init_weights()
    save_checkpoint(checkpoint_dir("sft", "d1", base), 3, model_state=model.state_dict(),
                    meta={"model_config": asdict(cfg), "tokenizer_fingerprint": tok.fingerprint, "model_tag": "d1"})
    out_path = tmp_path / "results.json"
    out = chat_eval.main(["-i", "sft", "--model-tag", "d1", "-x", "2", "--max-new-tokens", "8", "--device", "cpu",
                          "--out", str(out_path)])
    assert set(out["results"]) == set(EVAL_TASKS) and out["complete"] and out["step"] == 3
    for name, r in out["results"].items():
        assert r["total"] == 2 and 0 <= r["accuracy"] <= 1, name
    assert json.loads(out_path.read_text())["ChatCORE"] == pytest.approx(out["ChatCORE"])
    section = json.loads((base / "report" / "sections" / "chat-evaluation-sft.json").read_text())
    assert section["entries"][0]["data"]["ChatCORE metric"] == pytest.approx(out["ChatCORE"])
    # the fixed-shape decode (what CUDA graphs replay) scores the greedy generations identically
    static = chat_eval.main(["-i", "sft", "-x", "2", "--max-new-tokens", "8", "--device", "cpu",
                             "-a", "GSM8K|HumanEval|SpellingBee", "--decode", "static", "--out", str(out_path)])
    for name, r in static["results"].items():
        assert r["passed"] == out["results"][name]["passed"], name
    # without --model-tag the report still names the checkpoint evaluated (it said None)
    section = json.loads((base / "report" / "sections" / "chat-evaluation-sft.json").read_text())
    assert [e["data"]["model_tag"] for e in section["entries"]] == ["d1", "d1"]


# ------------------------------------------------------------------ broken / empty local files

def test_broken_local_files_are_data_errors_when_the_task_loads(tmp_path):
    from nanochat.errors import DataError, MissingDataError
    arc = tmp_path / "arc_easy.jsonl"
    good = json.dumps({"question": "2+2?", "choices": ["4", "5"], "answer": 0})
    arc.write_text(good + "\n" + '{"question": "x", "choices": [\n')
    with pytest.raises(DataError, match=f"{arc}:2: invalid JSON .*fix or delete that line"):
        ARC("easy", data_dir=tmp_path)
    arc.write_bytes(good.encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=f"{arc}:2: not UTF-8"):
        ARC("easy", data_dir=tmp_path)
    arc.write_text(good + "\n" + json.dumps({"choices": ["a"], "answer": 0}) + "\n")
    with pytest.raises(DataError, match=f"{arc}: row 2: missing 'question'"):  # at load, not at arc[1]
        ARC("easy", data_dir=tmp_path)
    arc.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": 7}) + "\n")
    with pytest.raises(DataError, match="'answer' must be an index 0..1"):
        ARC("easy", data_dir=tmp_path)
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DataError, match="gsm8k.jsonl: row 1: missing 'answer'"):
        GSM8K(data_dir=tmp_path)
    arc.write_text("\n\n")
    with pytest.raises(MissingDataError, match=f"{arc}: empty"):
        ARC("easy", data_dir=tmp_path)


def test_broken_or_empty_conversation_files(tmp_path):
    from nanochat.errors import DataError, MissingDataError
    sft = tmp_path / "sft"
    sft.mkdir()
    chat = sft / "chat.jsonl"
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    chat.write_text(json.dumps(ok) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=f"{chat}:2: messages\\[0\\].role is 'robot'"):
        LocalConversations("train", data_dir=sft)  # row 2 is a train row; the test split fails too
    with pytest.raises(DataError, match=f"{chat}:2"):
        LocalConversations("test", data_dir=sft)
    chat.write_text(json.dumps({"messages": ["just a string"]}) + "\n")
    with pytest.raises(DataError, match="every message must be an object"):
        LocalConversations("train", data_dir=sft)
    chat.write_text("")
    with pytest.raises(MissingDataError, match=f"{chat}: empty"):
        get_conversations("train", data_dir=sft)


# ------------------------------------------------------------------ eval-score audit (ARC / MMLU / evaluate)

def test_mmlu_max_problems_is_not_the_first_subjects(shared_data):
    """mmlu.jsonl is sorted by subject, so --max-problems 100 scored abstract algebra alone (and
    500 five subjects). The rows are shuffled once with a fixed seed (upstream: shuffle(seed=42)):
    the first N span the subjects, the same every run, and start/stop slices (the --test-holdout
    split of mid/SFT training) still partition the same order."""
    mmlu = MMLU(data_dir=shared_data)
    first = [mmlu[i] for i in range(100)]
    assert len({c["subject"] for c in first}) >= 30
    again = MMLU(data_dir=shared_data)
    assert first == [again[i] for i in range(100)]
    assert len(mmlu) == 14042 and sorted(r["question"] for r in mmlu.rows) == sorted(
        json.loads(line)["question"] for line in open(shared_data / "eval" / "mmlu.jsonl"))
    held = MMLU(data_dir=shared_data, start=100)
    assert held[0] == mmlu[100] and len(held) == len(mmlu) - 100


@pytest.mark.parametrize("completion, gold, ok", [
    ("B", "B", True), (" b", "B", True), ("B.", "B", True), ("(B)", "B", True), ("B) blue", "B", True),
    ("The answer is C", "C", True), ("The answer is (C).", "C", True), ("answer: D", "D", True),
    ("Answer: B", "A", False),            # read as "A" (its first character) before
    ("Because it is blue", "B", False),   # read as "B" before
    ("A", "B", False), ("I don't know", "B", False), ("", "A", False), ("E", "D", False),
    ("a bird", "A", False), ("The answer is a bird", "A", False),
    ("**B**", "B", True), ("**B.** blue", "B", True), ("*(c)*", "C", True),    # markdown: None before
    ("The answer is **C**.", "C", True), ("**Answer:** D", "D", True), ("__Answer__: (A)", "A", True),
    ("**Because** it is blue", "B", False), ("The answer is **a bird**", "A", False),
])
def test_letter_answers_are_read_like_a_grader(completion, gold, ok):
    from nanochat.tasks.arc import evaluate_letter, mc_conversation

    conv = mc_conversation("Sky colour?", ["green", "blue", "red", "black"], "ABCD".index(gold))
    assert evaluate_letter(conv, completion) is ok


class NaNLogits(torch.nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, idx, targets=None):
        return torch.full((*idx.shape, self.vocab_size), float("nan"))


def test_categorical_nan_logits_score_nothing(tok, shared_data):
    """argmax over NaN letter logits picked "A", so a diverged model scored the share of
    gold-A questions (~25%, ChatCORE ~0) instead of nothing."""
    arc = ARC("easy", data_dir=shared_data)
    res = run_categorical(NaNLogits(tok.vocab_size), tok, arc, "cpu", batch_size=8, max_problems=40)
    assert res.total == 40 and res.passed == 0


class _SeesInputs(torch.nn.Module):
    """Records each batch and answers with flat logits (the scoring is not what is tested here)."""

    def __init__(self, vocab_size, seq_len):
        super().__init__()
        self.vocab_size, self.config, self.seen = vocab_size, type("C", (), {"sequence_len": seq_len})(), []

    def forward(self, idx, targets=None):
        self.seen.append(idx.clone())
        return torch.zeros((*idx.shape, self.vocab_size))


def test_an_over_long_categorical_prompt_keeps_its_start_token(tok, shared_data):
    """A prompt past the model's context was cut from the left, start token included: the model
    was asked about a row unlike any it trained on. It keeps BOS and the end (choices, answer slot)."""
    arc = ARC("easy", data_dir=shared_data)
    model = _SeesInputs(tok.vocab_size, seq_len=24)
    run_categorical(model, tok, arc, "cpu", batch_size=1, max_problems=3)
    full = tok.render_for_completion(arc[0])
    assert len(full) > 24
    assert model.seen[0][0].tolist() == full[:1] + full[-23:] and full[0] == tok.bos_token_id


@pytest.mark.parametrize("messages, says", [
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "user", "content": "x"}],
     "messages[2].role is 'user'; expected 'assistant'"),
    ([{"role": "system", "content": "be brief"}], "a system message alone"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}], "messages[1].content"),
])
def test_conversation_errors_index_the_message_as_the_file_lists_it(messages, says):
    from nanochat.tasks.common import validate_conversation

    with pytest.raises(ValueError, match=re.escape(says)):
        validate_conversation({"messages": messages})
