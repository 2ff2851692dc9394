"""CORE evaluation: metric math, prompt rendering, token boundaries, scoring with fixed logits,
the offline task set on a tiny random model, and the DCLM bundle (download from a local server)."""

import http.server
import io
import json
import math
import threading
import zipfile

import pytest
import torch
import torch.nn as nn

from nanochat import core_data, core_eval
from nanochat.core_eval import (CORE_LABELS, CORE_TASKS, CoreTask, centered_accuracy, core_metric,
                                download_eval_bundle, evaluate_task, render_prompts, run_core_eval,
                                score_sequences, tokenize_item)


class ByteTok:
    """Bytes are tokens 0..255, BOS is 256: token boundaries are exactly character boundaries."""

    bos_token_id = 256
    vocab_size = 257

    def encode(self, text, prepend=None):
        if isinstance(text, list):
            return [self.encode(t, prepend) for t in text]
        return ([prepend] if prepend is not None else []) + list(text.encode())


class Bigram(nn.Module):
    """logits[b, t] = table[idx[b, t]]: a fixed next-token distribution per current token."""

    def __init__(self, table: torch.Tensor, seq_len: int = 4096):
        super().__init__()
        self.table = nn.Parameter(table)
        self.config = type("Cfg", (), {"sequence_len": seq_len})()

    def forward(self, idx, targets=None):
        return self.table[idx]


def bigram(prefs: dict[tuple[str, str], float], default: float = 0.0) -> Bigram:
    table = torch.full((257, 257), default)
    for (cur, nxt), logit in prefs.items():
        cur_ids = range(257) if cur == "*" else [ord(cur)]
        for c in cur_ids:
            table[c, ord(nxt)] = logit
    return Bigram(table)


def test_centered_accuracy_and_core_mean():
    assert centered_accuracy(0.25, 0.25) == 0.0
    assert centered_accuracy(1.0, 0.62) == pytest.approx(1.0)
    assert centered_accuracy(0.5, 0.0) == 0.5
    assert centered_accuracy(0.0, 0.5) == pytest.approx(-1.0)  # below chance goes negative
    assert core_metric({"a": 0.2, "b": 0.4, "c": -0.3}) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="random_baseline"):
        centered_accuracy(0.5, 25.0)  # percent instead of fraction
    with pytest.raises(ValueError, match="core_metric"):
        core_metric({})


def test_core_task_table_and_offline_coverage(shared_data):
    assert len(CORE_TASKS) == 22 and len(set(CORE_LABELS)) == 22
    assert all(0 <= t.random_baseline < 1 for t in CORE_TASKS)
    by = {t.label: t for t in CORE_TASKS}
    assert by["boolq"].random_baseline == pytest.approx(0.62) and by["winogrande"].task_type == "schema"
    assert by["squad"].continuation_delimiter == by["coqa"].continuation_delimiter == " "  # as core.yaml
    sources, _ = core_data._offline_sources(shared_data / "eval")
    offline = {t.label for t, _ in sources}
    assert set(CORE_LABELS) - offline == {"winograd", "agi_eval_lsat_ar"}
    for task, load in sources:  # every converted item has its type's fields
        item = load()[0]
        need = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
                "language_modeling": ("context", "continuation")}[task.task_type]
        assert all(k in item for k in need), task.label
    for label in ("squad", "coqa"):  # offline prompts end "...\nAnswer: <answer>" like the bundle's
        task, load = next((t, ld) for t, ld in sources if t.label == label)
        item = load()[0]
        ctx, cont = render_prompts(task, item, [])
        assert (ctx[0] + cont[0]).endswith("\nAnswer: " + item["continuation"])
    lsid = next(t for t, _ in sources if t.label == "bigbench_language_identification")
    assert lsid.preamble.startswith("Given a sentence")


MC = CoreTask("mc", "multiple_choice", 1, 0.5, "\nAnswer: ")
SC = CoreTask("sc", "schema", 1, 0.5, " ")
LM = CoreTask("lm", "language_modeling", 1, 0.0, " ")


def test_render_prompts_by_type():
    shot = {"query": "Q: 1+1?", "choices": ["3", "2"], "gold": 1}
    ctx, cont = render_prompts(MC, {"query": "Q: 2+2?", "choices": ["4", "5"], "gold": 0}, [shot])
    assert ctx == ["Q: 1+1?\nAnswer: 2\n\nQ: 2+2?\nAnswer:"] * 2 and cont == [" 4", " 5"]
    sshot = {"context_options": ["A cat", "A dog"], "continuation": "barks.", "gold": 1}
    ctx, cont = render_prompts(SC, {"context_options": ["The sun", "The moon"], "continuation": "shines.", "gold": 0}, [sshot])
    assert ctx == ["A dog barks.\n\nThe sun", "A dog barks.\n\nThe moon"] and cont == [" shines."] * 2
    ctx, cont = render_prompts(replace_preamble(LM, "Do it.\n\n"), {"context": "op 2 =", "continuation": "4"},
                               [{"context": "op 1 =", "continuation": "2"}])
    assert ctx == ["Do it.\n\nop 1 = 2\n\nop 2 ="] and cont == [" 4"]


def replace_preamble(task, preamble):
    from dataclasses import replace

    return replace(task, preamble=preamble)


def test_tokenize_item_boundaries_and_truncation():
    tok = ByteTok()
    (ids, start), = tokenize_item(tok, LM, ["hello there"], [" world"], max_len=100)
    assert ids[0] == 256 and bytes(ids[start:]).decode() == " world"
    seqs = tokenize_item(tok, SC, ["The sun", "The big moon"], [" shines."] * 2, max_len=100)
    assert [bytes(i[s:]).decode() for i, s in seqs] == ["n shines."] * 2  # upstream: the whole common suffix
    (ids, start), = tokenize_item(tok, LM, ["x" * 50], [" tail"], max_len=20)
    assert len(ids) == 20 and bytes(ids[start:]).decode() == " tail"  # cut from the left


def test_scoring_mean_vs_sum_lm_and_schema():
    tok = ByteTok()
    # after any token: 'a' likely (p~0.6), 'b' unlikely (p~0.1); after 'c' then 'x' is likely, after 'd' 'y'
    model = bigram({("*", "a"): 3.0, ("*", "b"): 1.2, ("c", "x"): 8.0, ("d", "y"): 8.0}, default=-5.0)
    task = CoreTask("mc", "multiple_choice", 0, 0.5, "")
    # choice 0 = "aaaab" (low mean NLL, high total), choice 1 = "b" (high mean, low total)
    item = {"query": "q", "choices": ["aaaab", "b"], "gold": 0}
    assert evaluate_task(model, tok, task, [item, item], "cpu", num_items=1, scoring="mean") == 1.0
    assert evaluate_task(model, tok, task, [item, item], "cpu", num_items=1, scoring="sum") == 0.0
    lm = CoreTask("lm", "language_modeling", 0, 0.0, "")
    good, bad = {"context": "q", "continuation": "aaa"}, {"context": "q", "continuation": "aab"}
    assert evaluate_task(model, tok, lm, [good, bad], "cpu") == 0.5  # greedy exact match only for "aaa"
    sc = CoreTask("sc", "schema", 0, 0.5, "")
    items = [{"context_options": ["qd", "qc"], "continuation": "x", "gold": 1},
             {"context_options": ["qd", "qc"], "continuation": "y", "gold": 0}]
    assert evaluate_task(model, tok, sc, items, "cpu") == 1.0


@pytest.mark.parametrize("kind", ["bigram", "gpt"])
def test_score_sequences_batching_is_invisible(kind):
    """Right padding, batch composition and power-of-two shape buckets must not change a score."""
    torch.manual_seed(0)
    model = Bigram(torch.randn(257, 257)) if kind == "bigram" else tiny_model(257, seq_len=128)
    tok = ByteTok()
    seqs = [(tok.encode("ab" * n + "c" * (n % 3), prepend=256), 1 + n) for n in range(1, 40, 3)]
    one = score_sequences(model, seqs, "cpu", pad_id=256, batch_tokens=1, fixed_shapes=False)
    many = score_sequences(model, seqs, "cpu", pad_id=256, batch_tokens=10_000, fixed_shapes=False)
    fixed = score_sequences(model, seqs, "cpu", pad_id=256, batch_tokens=300, max_len=128, fixed_shapes=True)
    for (m1, s1, e1), (m2, s2, e2), (m3, s3, e3) in zip(one, many, fixed):
        assert m1 == pytest.approx(m2, abs=1e-4) == pytest.approx(m3, abs=1e-4)
        assert s1 == pytest.approx(s2, abs=1e-3) and s1 == pytest.approx(s3, abs=1e-3) and e1 == e2 == e3


def test_fewshot_sampling_excludes_item_and_is_seeded(monkeypatch):
    seen = []
    real = core_eval.render_prompts

    def spy(task, item, fewshot):
        seen.append((item["context"], [f["context"] for f in fewshot]))
        return real(task, item, fewshot)

    monkeypatch.setattr(core_eval, "render_prompts", spy)
    data = [{"context": f"c{i}", "continuation": "x"} for i in range(8)]
    task = CoreTask("lm", "language_modeling", 5, 0.0, " ")
    model = bigram({})
    evaluate_task(model, ByteTok(), task, data, "cpu", seed=7)
    first = list(seen)
    assert all(item not in shots and len(shots) == 5 for item, shots in first)
    seen.clear()
    evaluate_task(model, ByteTok(), task, data, "cpu", seed=7)
    assert seen == first
    with pytest.raises(ValueError, match="5-shot"):
        evaluate_task(model, ByteTok(), task, data[:5], "cpu")


@pytest.fixture(scope="module")
def small_tokenizer(shared_data):
    tokenizer = pytest.importorskip("nanochat.tokenizer")
    texts = [json.loads(line)["question"] for line in open(shared_data / "eval" / "arc_easy.jsonl")][:400]
    texts += [json.loads(line)["text"] for line in open(shared_data / "eval" / "lambada.jsonl")][:100]
    return tokenizer.Tokenizer.train(texts, 512)


def tiny_model(vocab_size: int, seq_len: int = 256):
    """The project's GPT at depth 1 when gpt.py exists, else a random bigram model."""
    try:
        from nanochat.gpt import GPT, GPTConfig
    except ImportError:
        torch.manual_seed(0)
        return Bigram(torch.randn(vocab_size, vocab_size), seq_len)
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=seq_len, vocab_size=vocab_size, n_layer=1, n_head=2, n_kv_head=2,
                          n_embd=32, window_pattern="L"))
    model.init_weights()
    return model


def test_run_core_eval_offline_tiny_model(shared_data, small_tokenizer):
    model = tiny_model(small_tokenizer.vocab_size)
    logs = []
    out = run_core_eval(model, small_tokenizer, "cpu", max_per_task=2, data_dir=shared_data / "eval", log=logs.append)
    assert out["source"].startswith("offline")
    assert out["missing"] == ["winograd", "agi_eval_lsat_ar"] and not out["complete"]
    assert len(out["results"]) == 20 and set(out["available"]) == set(out["results"])
    baselines = {t.label: t.random_baseline for t in CORE_TASKS}
    for label, acc in out["results"].items():
        assert 0.0 <= acc <= 1.0 and out["num_examples"][label] == 2
        b = baselines[label]
        assert out["centered_results"][label] == pytest.approx((acc - b) / (1 - b))
    assert math.isfinite(out["core_metric"])
    assert out["core_metric"] == pytest.approx(sum(out["centered_results"].values()) / 20)
    assert any(line.startswith("CORE") for line in logs)
    # a subset of tasks, and bad input
    sub = run_core_eval(model, small_tokenizer, "cpu", max_per_task=1, tasks=["copa", "winograd"],
                        data_dir=shared_data / "eval", log=lambda *a: None)
    assert list(sub["results"]) == ["copa"] and sub["missing"] == ["winograd"]
    with pytest.raises(ValueError, match="CORE tasks: got"):
        run_core_eval(model, small_tokenizer, "cpu", tasks=["nope"], data_dir=shared_data / "eval")
    with pytest.raises(ValueError, match="--max-per-task"):
        run_core_eval(model, small_tokenizer, "cpu", max_per_task=0, data_dir=shared_data / "eval")


def test_no_data_anywhere_names_both(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    with pytest.raises(FileNotFoundError) as e:
        run_core_eval(bigram({}), ByteTok(), "cpu", data_dir=tmp_path / "empty")
    assert "eval_bundle" in str(e.value) and str(tmp_path / "empty") in str(e.value)


def _bundle_zip() -> bytes:
    core_yaml = """icl_tasks:
- label: tiny_mc
  dataset_uri: x/mc.jsonl
  num_fewshot: [1]
  icl_task_type: multiple_choice
  continuation_delimiter: "\\nAnswer: "
- label: tiny_schema
  dataset_uri: x/schema.jsonl
  num_fewshot: [0]
  icl_task_type: schema
- label: tiny_lm
  dataset_uri: y/lm.jsonl
  num_fewshot: [2]
  icl_task_type: language_modeling
- label: tiny_gone
  dataset_uri: z/absent.jsonl
  num_fewshot: [0]
  icl_task_type: language_modeling
"""
    meta = "Eval Task,Task Category,Task Type,#shots,#datapoints,Random baseline,Centered Metric?,Description\n" \
           "tiny_mc,x,multiple choice,1,4,50,,d\ntiny_schema,x,schema,0,4,50,,d\ntiny_lm,y,language modeling,2,4,0,,d\n" \
           "tiny_gone,z,language modeling,0,4,0,,d\n"
    mc = [{"query": f"Question {i}?", "choices": ["yes", "no"], "gold": i % 2} for i in range(4)]
    sc = [{"context_options": [f"Option {i}a", f"Option {i}b"], "continuation": "ends.", "gold": 0} for i in range(4)]
    lm = [{"context": f"Count {i}:", "continuation": str(i + 1)} for i in range(4)]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("eval_bundle/core.yaml", core_yaml)
        zf.writestr("eval_bundle/eval_meta_data.csv", meta)
        for name, rows in (("x/mc.jsonl", mc), ("x/schema.jsonl", sc), ("y/lm.jsonl", lm)):
            zf.writestr(f"eval_bundle/eval_data/{name}", "\n".join(json.dumps(r) for r in rows) + "\n")
    return buf.getvalue()


@pytest.fixture()
def http_server():
    files: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield files, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_bundle_download_and_eval(tmp_path, http_server):
    files, url = http_server
    files["/eval_bundle.zip"] = _bundle_zip()
    files["/junk.zip"] = b"not a zip"
    dest = download_eval_bundle(f"{url}/eval_bundle.zip", tmp_path / "bundle", retries=1)
    assert (dest / "core.yaml").is_file() and (dest / "eval_data" / "y" / "lm.jsonl").is_file()
    assert download_eval_bundle("http://127.0.0.1:9/never-fetched", dest) == dest  # cached: no request
    out = run_core_eval(bigram({}), ByteTok(), "cpu", bundle_dir=dest,
                        tasks=["tiny_mc", "tiny_schema", "tiny_lm", "tiny_gone"], log=lambda *a: None)
    assert out["source"] == f"bundle:{dest}" and set(out["results"]) == {"tiny_mc", "tiny_schema", "tiny_lm"}
    assert out["missing"] == ["tiny_gone"]
    assert out["centered_results"]["tiny_mc"] == pytest.approx(2 * out["results"]["tiny_mc"] - 1)
    with pytest.raises(RuntimeError, match="could not download"):
        download_eval_bundle(f"{url}/missing.zip", tmp_path / "b2", retries=1)
    with pytest.raises(ValueError, match="not a zip"):
        download_eval_bundle(f"{url}/junk.zip", tmp_path / "b3", retries=1)
    assert not (tmp_path / "b2").exists() and not (tmp_path / "b3").exists()
    with pytest.raises(FileNotFoundError, match="core.yaml"):
        run_core_eval(bigram({}), ByteTok(), "cpu", bundle_dir=tmp_path / "b2")


# --- parity with upstream nanochat's CORE (each of these failed before the session-42 fixes) ---

def test_lm_context_whitespace_is_trimmed():
    """The bundle's squad/coqa contexts end in "Answer: " and use the " " delimiter: contexts are
    trimmed (as upstream does) so one space, not two, precedes the answer, in shots and item."""
    shot = {"context": "Q: 1+1?\nAnswer: ", "continuation": "2"}
    ctx, cont = render_prompts(LM, {"context": " Q: 2+2?\nAnswer: ", "continuation": "4"}, [shot])
    assert ctx[0] + cont[0] == "Q: 1+1?\nAnswer: 2\n\nQ: 2+2?\nAnswer: 4" and cont == [" 4"]


def test_fewshot_examples_are_upstreams_draw(monkeypatch):
    """Item idx's shots are random.Random(1234 + idx).sample(<the evaluated items but idx>, k)."""
    import random

    seen = []
    real = core_eval.render_prompts
    monkeypatch.setattr(core_eval, "render_prompts",
                        lambda task, item, shots: seen.append((item, shots)) or real(task, item, shots))
    data = [{"context": f"c{i}", "continuation": "x"} for i in range(40)]
    task = CoreTask("lm", "language_modeling", 3, 0.0, " ")
    evaluate_task(bigram({}), ByteTok(), task, data, "cpu", num_items=12)
    assert len(seen) == 12
    for item, shots in seen:
        idx = int(item["context"][1:])
        want = random.Random(1234 + idx).sample([j for j in range(12) if j != idx], 3)
        assert [int(s["context"][1:]) for s in shots] == want
    for n, idx in ((5000, 0), (5000, 4999), (7, 3)):  # the O(k) draw equals sampling the explicit list
        assert core_eval.fewshot_indices(idx, n, 5) == random.Random(1234 + idx).sample(
            [j for j in range(n) if j != idx], 5)
    seen.clear()  # fewer items than shots: the shots come from the whole task (upstream would fail)
    evaluate_task(bigram({}), ByteTok(), task, data, "cpu", num_items=2)
    assert len(seen) == 2 and all(len(shots) == 3 and item not in shots for item, shots in seen)


def test_mc_scores_after_the_choices_common_prefix():
    """Tokens every choice shares after the context are not scored (upstream's common prefix), and
    a choice that is a prefix of another still scores its last token."""
    mc = CoreTask("mc", "multiple_choice", 0, 0.5, " ")
    seqs = tokenize_item(ByteTok(), mc, ["Q:"] * 2, [" the sun", " the moon"], max_len=100)
    assert [bytes(i[s:]).decode() for i, s in seqs] == ["sun", "moon"]
    seqs = tokenize_item(ByteTok(), mc, ["Q:"] * 2, [" ab", " abc"], max_len=100)
    assert [bytes(i[s:]).decode() for i, s in seqs] == ["b", "bc"]


# --- eval-score audit (each failed before its fix) ---

def test_cs_algorithms_prompts_carry_their_own_subtasks_preamble(shared_data):
    """bigbench_cs_algorithms mixes two subtasks with different instructions: each prompt starts
    with its own item's preamble (it was the file's first record's, LCS, for all 1,320 items)."""
    sources, _ = core_data._offline_sources(shared_data / "eval")
    task, load = next((t, ld) for t, ld in sources if t.label == "bigbench_cs_algorithms")
    items = load()
    raw = [json.loads(line) for line in open(shared_data / "eval" / "bigbench_cs_algorithms.jsonl")]
    seen = set()
    for item, r in zip(items, raw):
        ctx, _ = render_prompts(task, item, [])
        assert ctx[0].startswith(r["preamble"].strip() + "\n\n"), r["subtask"]
        seen.add(r["subtask"])
    assert seen == {"lcs", "valid_parentheses"}
    lang = next(ld for t, ld in sources if t.label == "bigbench_language_identification")()[0]
    lsid = next(t for t, _ in sources if t.label == "bigbench_language_identification")
    assert render_prompts(lsid, lang, [])[0][0].startswith("Given a sentence, select the correct language")


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


@pytest.mark.parametrize("bad, problem", [
    ({"question": "q", "choices": ["a", "b"], "answer": 2}, "answer"),      # past the last choice
    ({"question": "q", "choices": ["a", "b"], "answer": -1}, "answer"),     # would score the last choice
    ({"question": "q", "choices": ["a", "b"], "answer": 1.7}, "answer"),    # int() would truncate it
    ({"question": "q", "choices": "ab", "answer": 0}, "choices"),           # a string, not a list
    ({"question": "q", "choices": ["a", "b"], "answer": "x"}, "answer"),    # int("x"): ValueError
])
def test_offline_core_records_with_bad_answers_name_file_and_line(tmp_path, bad, problem):
    """An answer index out of range (or not an index) used to load silently: the item could never
    be scored correct, or a shot rendered the wrong choice. Now DataError names path:line."""
    good = {"question": "q", "choices": ["a", "b"], "answer": 0}
    path = tmp_path / "arc_easy.jsonl"
    _write_jsonl(path, [good] * 3 + ["", bad] + [good] * 12)   # the bad record is on line 5
    with pytest.raises(core_data.DataError) as e:
        core_eval.load_core_data(tasks=["arc_easy"], data_dir=tmp_path)
    msg = str(e.value)
    assert (f"{path}:5: " in msg or (f"{path}: record 4 " in msg and "line 5" in msg)) and problem in msg, msg


def test_offline_core_schema_and_lm_records_are_checked(tmp_path):
    wino = tmp_path / "winogrande.jsonl"
    _write_jsonl(wino, [{"question": "A _ b.", "choices": ["x", "y"], "answer": 1}] * 2
                 + [{"question": "A _ b.", "choices": ["x", "y"], "answer": 2}])
    with pytest.raises(core_data.DataError, match=rf"{wino}:3: .*answer"):
        core_eval.load_core_data(tasks=["winogrande"], data_dir=tmp_path)
    lam = tmp_path / "lambada.jsonl"
    _write_jsonl(lam, [{"text": "one two three"}, {"text": "   "}])   # no word to predict
    with pytest.raises(core_data.DataError, match=rf"{lam}:2: .*continuation"):
        core_eval.load_core_data(tasks=["lambada_openai"], data_dir=tmp_path)
    hs = tmp_path / "hellaswag.jsonl"
    _write_jsonl(hs, [{"activity_label": "a", "ctx": "c", "endings": ["x", "y"], "label": ""}])
    with pytest.raises(core_data.DataError, match=rf"{hs}: record 1 .*ValueError.*line 1"):  # unlabelled row
        core_eval.load_core_data(tasks=["hellaswag"], data_dir=tmp_path)


def test_bundle_records_are_checked_before_the_model(tmp_path):
    pytest.importorskip("yaml")
    bundle = tmp_path / "bundle"
    (bundle / "eval_data" / "x").mkdir(parents=True)
    (bundle / "core.yaml").write_text("icl_tasks:\n- label: t\n  dataset_uri: x/t.jsonl\n  num_fewshot: [0]\n"
                                      "  icl_task_type: multiple_choice\n")
    (bundle / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nt,50\n")
    path = bundle / "eval_data" / "x" / "t.jsonl"
    _write_jsonl(path, [{"query": "q", "choices": ["a", "b"], "gold": 0}, {"query": "q", "choices": ["a", "b"], "gold": 5}])
    with pytest.raises(core_data.DataError, match=rf"{path}:2: .*gold"):
        core_eval.load_core_data(tasks=["t"], bundle_dir=bundle)
    _write_jsonl(path, [{"query": "q", "choices": ["a", "b"], "gold": 0}, {"query": "q", "gold": 1}])
    with pytest.raises(core_data.DataError, match=rf"{path}:2: .*choices"):
        core_eval.load_core_data(tasks=["t"], bundle_dir=bundle)


def test_identical_choices_score_the_gold_text():
    """CommonsenseQA has items whose gold choice repeats an earlier one (24 items with a repeated
    choice, 2 with the gold on the later copy): identical texts tie exactly, and argmin took the
    first copy, so such an item was always wrong whatever the model."""
    model = bigram({("*", "x"): 5.0})
    task = CoreTask("mc", "multiple_choice", 0, 0.2, " ")
    item = {"query": "q", "choices": ["x", "y", "x"], "gold": 2}
    assert evaluate_task(model, ByteTok(), task, [item], "cpu") == 1.0
    other = {"query": "q", "choices": ["x", "y", "x"], "gold": 1}
    assert evaluate_task(model, ByteTok(), task, [other], "cpu") == 0.0


class NaNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Cfg", (), {"sequence_len": 64})()

    def forward(self, idx, targets=None):
        return torch.full((*idx.shape, 257), float("nan"))


def test_non_finite_scores_never_count_as_correct():
    """A diverged model (NaN logits) scored every multiple-choice item whose gold is choice 0 as
    correct (min() keeps the first of incomparable keys): e.g. ~38% on BoolQ. Now it scores 0."""
    task = CoreTask("mc", "multiple_choice", 0, 0.5, " ")
    items = [{"query": "q", "choices": ["a", "b"], "gold": g} for g in (0, 0, 1)]
    assert evaluate_task(NaNModel(), ByteTok(), task, items, "cpu") == 0.0
    sc = CoreTask("sc", "schema", 0, 0.5, " ")
    assert evaluate_task(NaNModel(), ByteTok(), sc, [{"context_options": ["a", "b"], "continuation": "c",
                                                      "gold": 0}], "cpu") == 0.0


def test_offline_answers_lose_stray_edge_whitespace(tmp_path):
    """10 Jeopardy answers end in a space ("NATO "): exact match then needed a lone " " token after
    the answer, so those items were always wrong; 118 PIQA items have a choice ending in a space,
    an extra unlikely token scored against that choice. The delimiter supplies the only space."""
    jeo = [{"category": "ORGS", "question": f"Alliance {i}", "answer": "NATO "} for i in range(11)]
    _write_jsonl(tmp_path / "jeopardy.jsonl", jeo)
    _write_jsonl(tmp_path / "piqa.jsonl", [{"question": "q", "choices": ["a pin ", " b"], "answer": 0}] * 11)
    data = core_eval.load_core_data(tasks=["jeopardy", "piqa"], data_dir=tmp_path)
    (jtask, jitems), (_, pitems) = data.tasks
    assert jitems[0]["continuation"] == "NATO" and pitems[0]["choices"] == ["a pin", "b"]
    # a model that answers exactly "NATO" (then a newline) now scores the item
    model = bigram({(":", " "): 9.0, (" ", "N"): 9.0, ("N", "A"): 9.0, ("A", "T"): 9.0, ("T", "O"): 9.0,
                    ("O", "\n"): 9.0})
    assert evaluate_task(model, ByteTok(), jtask, jitems, "cpu", num_items=1) == 1.0
