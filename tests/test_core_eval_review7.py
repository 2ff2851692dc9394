"""CORE review 7: base_eval / core_eval / core_data used as a demanding user would.

Defects fixed (each test marked "was:" failed before its fix):
* core_eval.tokenize_items: an answer longer than the model's window was cropped from the left
  silently (the docstring said the scored tokens were kept); a language-modeling item was then
  judged "exact" on its last tokens only, so a model that got the answer's first tokens wrong
  scored it correct. Now the loss is reported per item (answer_cut), such an LM item counts
  wrong, and evaluate_task warns with the count.
* core_data._item_problem: a schema item with an empty continuation, or a multiple-choice item
  with an empty choice, loaded silently and was decided by the delimiter's space alone.
The rest guard hand-computed scoring and the centered CORE arithmetic through base_eval.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch

from nanochat import core_data, core_eval
from nanochat.core_eval import CoreData, CoreTask, evaluate_task, run_core_eval, tokenize_items
from tests.test_core_audit import NextByte
from tests.test_eval_edge import ByteTok

LM = CoreTask("lm", "language_modeling", 0, 0.0, " ")
LM_RAW = CoreTask("lm", "language_modeling", 0, 0.0, "")   # no delimiter: the answer follows the context
MC = CoreTask("mc", "multiple_choice", 0, 0.5, " ")


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def bundle(tmp_path, tasks: list[tuple[str, str, int, float, list[dict]]]):
    """A DCLM-style bundle: (label, icl_task_type, shots, baseline %, records) per task."""
    pytest.importorskip("yaml")
    d = tmp_path / "bundle"
    yaml = "icl_tasks:\n" + "".join(f"- label: {label}\n  dataset_uri: x/{label}.jsonl\n  num_fewshot: [{shots}]\n"
                                    f"  icl_task_type: {kind}\n" for label, kind, shots, _, _ in tasks)
    (d / "eval_data" / "x").mkdir(parents=True)
    (d / "core.yaml").write_text(yaml)
    (d / "eval_meta_data.csv").write_text("Eval Task,Random baseline\n" + "".join(
        f"{label},{b}\n" for label, _, _, b, _ in tasks))
    for label, _, _, _, rows in tasks:
        write_jsonl(d / "eval_data" / "x" / f"{label}.jsonl", rows)
    return d


# ------------------------------------------------------------------ answers longer than the window

def test_answer_cut_is_flagged_exactly_at_the_window_edge():
    tok = ByteTok()
    # BOS + "x" + " " + 17 answer bytes = 20 tokens; the answer is " " + 17 bytes = 18 scored tokens
    ctx, cont = ["x"], [" " + "a" * 17]
    for max_len, lost in ((19, False), (18, True), (10, True)):
        cut: list[bool] = []
        (ids, start), = tokenize_items(tok, LM, [(ctx, cont)], max_len, cut)[0]
        assert cut == [lost] and len(ids) == min(20, max_len) and start >= 1
        if not lost:   # the whole answer is scored, one context token before it
            assert bytes(ids[start:]).decode() == cont[0]
    cut = []
    tokenize_items(tok, LM, [(["long " * 20], [" ok"])], 16, cut)
    assert cut == [False]   # a long context alone is not a cut answer


def test_lm_answer_longer_than_the_window_is_not_an_exact_match(capsys):
    """was: scored correct. The model predicts 'a' after everything; the answer 'b' + 30 x 'a'
    is wrong at its first token, which no longer fits in a 20-token window."""
    model = NextByte({"*": "a"})
    wrong = {"context": "q", "continuation": "b" + "a" * 30}
    right = {"context": "q", "continuation": "aaa"}
    assert evaluate_task(model, ByteTok(), LM_RAW, [wrong], "cpu", max_seq_len=20) == 0.0
    assert "1 of 1 items have answers longer than the model's 20-token window (counted wrong)" \
        in capsys.readouterr().out
    assert evaluate_task(model, ByteTok(), LM_RAW, [right, right], "cpu", max_seq_len=20) == 1.0
    assert "warning" not in capsys.readouterr().out
    # with room for the whole answer the verdict is the same: wrong
    assert evaluate_task(model, ByteTok(), LM_RAW, [wrong], "cpu", max_seq_len=64) == 0.0


def test_mc_with_cut_choices_still_scores_and_warns(capsys):
    model = NextByte({"*": "a"})
    item = {"query": "q", "choices": ["a" * 40, "b" * 40], "gold": 0}
    assert evaluate_task(model, ByteTok(), MC, [item], "cpu", max_seq_len=16) == 1.0
    assert "(scored on the tokens that fit)" in capsys.readouterr().out


# ------------------------------------------------------------------ odd rows in a task file

@pytest.mark.parametrize("kind, bad, field", [
    ("schema", {"context_options": ["The cat", "The dog"], "continuation": "  ", "gold": 0}, "continuation"),
    ("multiple_choice", {"query": "q", "choices": ["yes", " "], "gold": 0}, "choices"),
])
def test_empty_answers_stop_the_load_naming_the_line(tmp_path, kind, bad, field):
    """was: loaded silently; the item was then decided by the delimiter's space alone."""
    good = ({"context_options": ["The cat", "The dog"], "continuation": "sat.", "gold": 0} if kind == "schema"
            else {"query": "q", "choices": ["yes", "no"], "gold": 0})
    d = bundle(tmp_path, [("t", kind, 0, 50, [good, bad])])
    with pytest.raises(core_data.DataError, match=rf"t\.jsonl:2: '{field}'.*empty"):
        core_eval.load_core_data(tasks=["t"], bundle_dir=d)
    write_jsonl(d / "eval_data" / "x" / "t.jsonl", [good, good])
    assert len(core_eval.load_core_data(tasks=["t"], bundle_dir=d).tasks[0][1]) == 2


def test_unicode_rows_score_by_hand_computed_nll():
    """Bytes as tokens: the scored span of 'é' (2 bytes) vs 'e' (1 byte) under a model that favours
    byte 0xC3 after the space: per-token mean NLL decides, by the numbers computed here."""
    table = torch.zeros(257, 257)
    table[ord(" "), 0xC3] = 4.0
    model = NextByte({})
    model.table.data = table
    item = {"query": "q", "choices": ["é", "e"], "gold": 0}
    z = math.log(256 + math.exp(4.0))          # log-sum-exp of a row with one logit 4 and 256 zeros
    nll_e_acute = ((z - 4.0) + math.log(257)) / 2   # " " -> 0xC3 favoured, 0xC3 -> 0xA9 uniform
    nll_e = math.log(256 + math.exp(4.0))           # " " -> 'e' is one of the zeros
    assert nll_e_acute < nll_e
    assert evaluate_task(model, ByteTok(), MC, [item], "cpu") == 1.0
    scores = core_eval.score_sequences(model, tokenize_items(ByteTok(), MC, [(["q"] * 2, [" é", " e"])], 99)[0],
                                       "cpu", pad_id=256)
    assert scores[0][0] == pytest.approx(nll_e_acute, rel=1e-5) and scores[1][0] == pytest.approx(nll_e, rel=1e-5)


def test_centered_core_arithmetic_by_hand():
    model = NextByte({"*": "a", "b": "c"})   # 'a' after everything, but 'c' after 'b'
    mc = CoreTask("mc", "multiple_choice", 0, 0.25, " ")
    sc = CoreTask("sc", "schema", 0, 0.5, "")
    mc_items = [{"query": "q", "choices": ["aa", "bb", "cb", "db"], "gold": g} for g in (0, 0, 1, 2)]   # 2/4
    # the shared continuation 'c' is likelier after option "xb": gold 1 right, gold 0 wrong: 2/3
    sc_items = [{"context_options": ["xa", "xb"], "continuation": "c", "gold": g} for g in (1, 1, 0)]
    lm_items = [{"context": "q", "continuation": c} for c in ("aa", "ab", "ba", "aaa", "b")]            # 2/5
    data = CoreData("offline:test", ["mc", "sc", "lm"], [(mc, mc_items), (sc, sc_items), (LM_RAW, lm_items)])
    out = run_core_eval(model, ByteTok(), "cpu", data=data, log=lambda *a: None)
    assert out["results"] == pytest.approx({"mc": 0.5, "sc": 2 / 3, "lm": 0.4})
    centered = {"mc": (0.5 - 0.25) / 0.75, "sc": (2 / 3 - 0.5) / 0.5, "lm": 0.4}
    assert out["centered_results"] == pytest.approx(centered)
    assert out["core_metric"] == pytest.approx(sum(centered.values()) / 3)
    assert not out["complete"] and out["all_items"]


# ------------------------------------------------------------------ base_eval on a tiny checkpoint

def test_base_eval_core_on_a_small_bundle_writes_consistent_results(base_dir, tiny_tokenizer, env, tmp_path,
                                                                    monkeypatch, capsys):
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.gpt import GPT, GPTConfig
    from scripts import base_eval

    config = GPTConfig(sequence_len=32, vocab_size=tiny_tokenizer.vocab_size, n_layer=2, n_head=2, n_kv_head=2,
                       n_embd=32, window_pattern="L")
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    save_checkpoint(checkpoint_dir("base", "d2", base_dir), 3, model_state=model.state_dict(),
                    meta={"model_config": asdict(config), "tokenizer_fingerprint": tiny_tokenizer.fingerprint})
    long = "To be, or not to be, that is the question: " * 12          # far past 32 tokens
    rows_mc = [{"query": f"{long} Q{i}: ¿Qué?", "choices": ["sí", "no", "日本"], "gold": i % 3} for i in range(6)]
    rows_lm = [{"context": f"{long} {i}", "continuation": " lord" if i % 2 else " " + "word " * 40} for i in range(6)]
    rows_sc = [{"context_options": ["The king", "The fool"], "continuation": "speaks.", "gold": i % 2}
               for i in range(6)]
    d = bundle(tmp_path, [("copa", "multiple_choice", 1, 33.3, rows_mc), ("squad", "language_modeling", 1, 0, rows_lm),
                          ("winogrande", "schema", 0, 50, rows_sc)])
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE", str(d))
    out = tmp_path / "res.json"
    res = base_eval.main(["--eval", "core", "--device", "cpu", "--dtype", "float32", "--max-per-task", "4",
                          "--output", str(out)])
    saved = json.loads(out.read_text())
    core = saved["core"]
    assert saved["step"] == 3 and core["num_examples"] == {"copa": 4, "squad": 4, "winogrande": 4} and not core["all_items"]
    for label, b in (("copa", 0.333), ("squad", 0.0), ("winogrande", 0.5)):
        assert core["centered_results"][label] == pytest.approx((core["results"][label] - b) / (1 - b))
    assert core["core_metric"] == pytest.approx(sum(core["centered_results"].values()) / 3)
    assert not core["complete"] and len(core["missing"]) == 19   # the bundle's other CORE tasks
    assert res["core"]["core_metric"] == pytest.approx(core["core_metric"])
    assert not list(tmp_path.glob(".res.json.tmp-*"))   # written via a temp file, nothing left behind
    assert "window (counted wrong)" in capsys.readouterr().out   # the 41-token answers cannot fit in 32
