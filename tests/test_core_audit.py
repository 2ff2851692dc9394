"""Audit of CORE (nanochat/core_eval.py, core_data.py) and scripts/base_eval.py against the metric's
definition: token boundaries, left truncation, batching, random baselines, aggregation, few-shot
draws, rank dealing, a missing or partial eval bundle, and flags rejected before any heavy work.
Scripted tokenizers and models only; CPU; a few seconds in all."""

import random
import re

import pytest
import torch
import torch.nn as nn

from nanochat import core_data, core_eval
from nanochat.core_eval import (CORE_TASKS, CoreData, CoreTask, evaluate_task, fewshot_indices, render_prompts,
                                run_core_eval, tokenize_item)
from tests.test_eval_edge import ByteTok


class WordTok:
    """GPT-style pre-tokenization without merges: a word takes its leading space (' Paris'), every
    other character is its own token. Ids are assigned on first sight; BOS is 0."""

    bos_token_id = 0

    def __init__(self):
        self.ids, self.words = {"<bos>": 0}, ["<bos>"]

    def _id(self, piece):
        if piece not in self.ids:
            self.ids[piece] = len(self.words)
            self.words.append(piece)
        return self.ids[piece]

    def encode(self, text, prepend=None):
        if isinstance(text, list):
            return [self.encode(t, prepend) for t in text]
        pieces = re.findall(r" ?[A-Za-z0-9]+|\s|[^\sA-Za-z0-9]", text)
        return ([prepend] if prepend is not None else []) + [self._id(p) for p in pieces]

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)


class NextByte(nn.Module):
    """Predicts byte `favourite[current]` with logit 10 (else uniform): a scripted scorer."""

    def __init__(self, favourite: dict[str, str], seq_len: int = 4096):
        super().__init__()
        table = torch.zeros(257, 257)
        for cur, nxt in favourite.items():
            for c in (range(257) if cur == "*" else [ord(cur)]):
                table[c, ord(nxt)] = 10.0
        self.table = nn.Parameter(table)
        self.config = type("Cfg", (), {"sequence_len": seq_len})()

    def forward(self, idx, targets=None):
        return self.table[idx]


def scored_text(tok, seqs):
    return [tok.decode(ids[start:]) for ids, start in seqs]


# ---------------------------------------------------------------------------------------------
# Token boundaries and truncation (checked right)
# ---------------------------------------------------------------------------------------------

def test_leading_space_belongs_to_the_continuation_and_mc_skips_the_common_prefix():
    tok = WordTok()
    mc = CoreTask("mc", "multiple_choice", 0, 0.25, "\nAnswer: ")
    item = {"query": "Question: capital of France?", "choices": ["Paris", "London"], "gold": 0}
    ctx, cont = render_prompts(mc, item, [])
    assert ctx[0].endswith("\nAnswer:") and cont == [" Paris", " London"]   # the space moved, not lost
    assert scored_text(tok, tokenize_item(tok, mc, ctx, cont, 1000)) == [" Paris", " London"]
    # choices sharing their first word: only the differing tokens are compared (upstream's rule)
    item = {"query": "Q: where?", "choices": ["New York", "New Delhi"], "gold": 1}
    ctx, cont = render_prompts(mc, item, [])
    assert scored_text(tok, tokenize_item(tok, mc, ctx, cont, 1000)) == [" York", " Delhi"]
    # language modeling: the context's own tokens are not scored, the continuation's all are
    lm = CoreTask("lm", "language_modeling", 0, 0.0, "\nAnswer: ")
    ctx, cont = render_prompts(lm, {"context": "Question: capital of France?  ", "continuation": "Paris"}, [])
    assert scored_text(tok, tokenize_item(tok, lm, ctx, cont, 1000)) == [" Paris"]
    # schema: the shared continuation (common token suffix) is scored under each context
    sc = CoreTask("sc", "schema", 0, 0.5, " ")
    item = {"context_options": ["The cup is bigger than the ball so the cup",
                                "The cup is bigger than the ball so the ball"], "continuation": "fits", "gold": 1}
    ctx, cont = render_prompts(sc, item, [])
    assert scored_text(tok, tokenize_item(tok, sc, ctx, cont, 1000)) == [" fits", " fits"]


def test_long_contexts_lose_tokens_from_the_left_and_keep_the_continuation():
    tok = WordTok()
    lm = CoreTask("lm", "language_modeling", 0, 0.0, " ")
    context = " ".join(f"w{i}" for i in range(50))
    ctx, cont = render_prompts(lm, {"context": context, "continuation": "end here"}, [])
    full = tok.encode(ctx[0] + cont[0], prepend=0)
    (ids, start), = tokenize_item(tok, lm, ctx, cont, 16)
    assert len(full) > 16 and ids == full[:1] + full[-15:]       # BOS, then the newest 15 tokens
    assert tok.decode(ids[start:]) == " end here"
    mc = CoreTask("mc", "multiple_choice", 0, 0.5, " ")
    seqs = tokenize_item(tok, mc, [context] * 2, [" yes", " no way"], 10)
    assert [len(ids) for ids, _ in seqs] == [10, 10] and scored_text(tok, seqs) == [" yes", " no way"]


# ---------------------------------------------------------------------------------------------
# Scoring, centering and aggregation (checked right)
# ---------------------------------------------------------------------------------------------

def test_batching_and_chunking_do_not_change_accuracy():
    torch.manual_seed(0)
    model = NextByte({})
    model.table.data += torch.randn(257, 257)
    task = CoreTask("mc", "multiple_choice", 2, 0.25, " ")
    data = [{"query": f"q{i} " + "x" * (i % 7), "choices": ["ab", "ba", "abc", "c"], "gold": i % 4}
            for i in range(24)]
    runs = {(bt, ch): evaluate_task(model, ByteTok(), task, data, "cpu", batch_tokens=bt, chunk_items=ch)
            for bt, ch in ((1, 1), (64, 5), (100_000, 256))}
    assert len(set(runs.values())) == 1, runs


def test_mc_lowest_nll_wins_and_lm_needs_an_exact_greedy_match():
    # the model strongly predicts ' ' after 'x', 'a' after a space and after 'a'
    model = NextByte({"x": " ", " ": "a", "a": "a"})
    mc = CoreTask("mc", "multiple_choice", 0, 0.5, " ")
    item = {"query": "pick", "choices": ["aaaa", "b"], "gold": 0}
    assert evaluate_task(model, ByteTok(), mc, [item, item], "cpu") == 1.0
    lm = CoreTask("lm", "language_modeling", 0, 0.0, " ")
    items = [{"context": "x", "continuation": "aaa"}, {"context": "x", "continuation": "aab"}]
    assert evaluate_task(model, ByteTok(), lm, items, "cpu") == 0.5   # one wrong token = wrong


def test_random_baselines_are_the_dclm_ones():
    dclm_pct = {"hellaswag_zeroshot": 25, "jeopardy": 0, "bigbench_qa_wikidata": 0, "arc_easy": 25,
                "arc_challenge": 25, "copa": 50, "commonsense_qa": 20, "piqa": 50, "openbook_qa": 25,
                "lambada_openai": 0, "hellaswag": 25, "winograd": 50, "winogrande": 50,
                "bigbench_dyck_languages": 0, "agi_eval_lsat_ar": 20, "bigbench_cs_algorithms": 0,
                "bigbench_operators": 0, "bigbench_repeat_copy_logic": 0, "squad": 0, "coqa": 0, "boolq": 62}
    shots = {"hellaswag_zeroshot": 0, "copa": 0, "openbook_qa": 0, "lambada_openai": 0, "winograd": 0,
             "winogrande": 0, "coqa": 0, "agi_eval_lsat_ar": 3}
    by = {t.label: t for t in CORE_TASKS}
    for label, pct in dclm_pct.items():
        assert by[label].random_baseline == pytest.approx(pct / 100), label
    for t in CORE_TASKS:
        assert t.num_fewshot == shots.get(t.label, 10), t.label


def test_per_task_centering_and_core_mean(monkeypatch):
    """Two scripted tasks with known accuracies: 3/4 on a 50%-baseline MC task, 1/2 on an LM task."""
    model = NextByte({"x": " ", " ": "a", "a": "a"})
    mc = CoreTask("mc2", "multiple_choice", 0, 0.5, " ")
    lm = CoreTask("lm0", "language_modeling", 0, 0.0, " ")
    mc_items = [{"query": f"q{i}", "choices": ["aaa", "bbb"], "gold": int(i == 3)} for i in range(4)]
    lm_items = [{"context": "x", "continuation": "aa"}, {"context": "x", "continuation": "ab"}]
    data = CoreData("test", ["mc2", "lm0"], [(mc, mc_items), (lm, lm_items)])
    out = run_core_eval(model, ByteTok(), "cpu", data=data, log=lambda *a: None)
    assert out["results"] == {"mc2": 0.75, "lm0": 0.5}
    assert out["centered_results"] == {"mc2": pytest.approx(0.5), "lm0": pytest.approx(0.5)}
    assert out["core_metric"] == pytest.approx(0.5) and out["num_examples"] == {"mc2": 4, "lm0": 2}
    assert not out["complete"] and out["all_items"]


# ---------------------------------------------------------------------------------------------
# Few-shot draws and rank dealing (checked right)
# ---------------------------------------------------------------------------------------------

def test_fewshot_draw_is_upstreams_and_never_the_item():
    for n, k in ((11, 10), (50, 3), (200, 10), (4, 1)):
        for idx in range(0, n, max(1, n // 7)):
            want = random.Random(1234 + idx).sample([i for i in range(n) if i != idx], k)
            got = fewshot_indices(idx, n, k)
            assert got == want and idx not in got and len(set(got)) == k


class Recording:
    """The scripted model, recording every batch it is given (as nested lists of ids)."""

    def __init__(self, model):
        self.model, self.batches = model, []

    def __call__(self, x):
        self.batches.append(x.tolist())
        return self.model(x)


class ThreadRanks:
    """Two ranks as two threads of this process: _dist answers each thread's own rank, and gather_ranks
    (tasks.evaluate's collective) exchanges the threads' rows through a barrier."""

    def __init__(self, world: int):
        import threading
        self.world, self.local = world, threading.local()
        self.barrier, self.parts = threading.Barrier(world, timeout=20), [None] * world

    def dist(self):
        return self.local.rank, self.world

    def gather(self, label, mine, error):
        assert error is None and label == "CORE lm"
        self.parts[self.local.rank] = mine
        self.barrier.wait()
        rows = sorted(x for part in self.parts for x in part)
        self.barrier.wait()   # every rank has read the parts before the next gather writes them
        return rows

    def run(self, fn):
        import threading
        out: dict[int, object] = {}

        def body(rank):
            self.local.rank = rank
            out[rank] = fn(rank)
        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(out) == list(range(self.world)), "a rank thread failed (see its traceback above)"
        return [out[r] for r in range(self.world)]


def test_two_simulated_ranks_score_one_process_batches_and_decide_each_item_once(monkeypatch):
    """Contract (was: each rank rendered, batched and scored only its own items, so a sequence sat in
    a batch of another shape and padding than on one process): rank r renders and tokenizes items
    i % 2 == r (with one process's shots) and the ranks gather the sequences; the task's batches,
    one process's, numbered across chunks, go whole to rank g % 2; the gathered scores decide every
    item once, alike on both ranks, as on one process. The ranks are two threads (ThreadRanks)."""
    from nanochat.tasks import evaluate as task_eval

    task = CoreTask("lm", "language_modeling", 3, 0.0, " ")
    data = [{"context": "c" * (1 + i % 4) + str(i), "continuation": "a" if i % 3 else "b"} for i in range(13)]
    ranks = ThreadRanks(2)
    seen: dict[int, list] = {0: [], 1: []}
    real_render = core_eval.render_prompts

    def render(t, item, shots):
        seen[ranks.dist()[0]].append((item["context"], [s["context"] for s in shots]))
        return real_render(t, item, shots)

    def run(rank):
        model, verdicts = Recording(NextByte({**dict.fromkeys("0123456789", " "), " ": "a"})), []
        # chunks of 5, 5 and 3 items (one sequence each, 25..32 tokens), batches of <= 80 tokens:
        # 3 + 2 + 2 batches of 1..3 rows, so the 2nd and 3rd chunks begin on rank 1's turn
        acc = evaluate_task(model, ByteTok(), task, data, "cpu", chunk_items=5, batch_tokens=2 * 40,
                            per_item=verdicts)
        return acc, verdicts, model.batches

    monkeypatch.setattr(core_eval, "render_prompts", render)
    ranks.local.rank = 0
    single_acc, single_items, single_batches = run(0)   # no process group: one process
    single_seen, seen[0] = seen[0], []
    assert 0 < sum(single_items) < len(data) and len(single_batches) == 7
    monkeypatch.setattr(core_eval, "_dist", ranks.dist)
    monkeypatch.setattr(task_eval, "gather_ranks", ranks.gather)
    (acc0, items0, batches0), (acc1, items1, batches1) = ranks.run(run)
    # each item rendered once, by rank i % 2, with one process's shots
    assert seen[0] == single_seen[0::2] and seen[1] == single_seen[1::2]
    # one process's batches, dealt whole: rank 0 the task's 1st, 3rd, ...; rank 1 its 2nd, 4th, ...
    assert batches0 == single_batches[0::2] and batches1 == single_batches[1::2]
    # every item decided on both ranks, as one process decided it
    assert items0 == items1 == single_items and acc0 == acc1 == single_acc


# ---------------------------------------------------------------------------------------------
# A missing or partial eval bundle (bugs fixed: raw FileNotFoundError, NaN CORE, silent fallback)
# ---------------------------------------------------------------------------------------------

COPA_YAML = ("icl_tasks:\n- label: copa\n  dataset_uri: commonsense_reasoning/copa.jsonl\n"
             "  num_fewshot: [0]\n  icl_task_type: multiple_choice\n")


def test_bundle_without_its_baselines_csv_names_the_file_and_the_fix(tmp_path):
    (tmp_path / "core.yaml").write_text(COPA_YAML)
    with pytest.raises(FileNotFoundError) as e:
        core_data.load_core_data(bundle_dir=tmp_path)
    assert isinstance(e.value, ValueError)   # a RequestError: script_main prints one line, no traceback
    assert str(tmp_path / "eval_meta_data.csv") in str(e.value) and "download_eval_bundle" in str(e.value)


def test_bundle_without_any_task_file_is_an_error_not_a_nan_core(tmp_path):
    (tmp_path / "core.yaml").write_text(COPA_YAML)
    (tmp_path / "eval_meta_data.csv").write_text("Eval Task,Random baseline\ncopa,50\n")
    with pytest.raises(FileNotFoundError) as e:
        core_data.load_core_data(bundle_dir=tmp_path)
    assert str(tmp_path / "eval_data") in str(e.value) and "download_eval_bundle" in str(e.value)


def test_a_named_bundle_dir_without_core_yaml_does_not_fall_back_to_offline(tmp_path, monkeypatch, shared_data):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE", str(tmp_path / "typo"))
    with pytest.raises(FileNotFoundError) as e:
        core_data.resolve_sources(data_dir=shared_data / "eval")
    assert "NANOCHAT_EVAL_BUNDLE" in str(e.value) and str(tmp_path / "typo") in str(e.value)
    monkeypatch.delenv("NANOCHAT_EVAL_BUNDLE")   # the default location may be absent: offline data is used
    assert core_data.resolve_sources(data_dir=shared_data / "eval")[1].startswith("offline:")


# ---------------------------------------------------------------------------------------------
# base_eval flags and order of checks
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--eval", "core,cor"], "--eval"), (["--eval", ""], "--eval"), (["--max-per-task", "0"], "--max-per-task"),
    (["--max_per_task", "-2"], "--max-per-task"), (["--model-tag", "../d20"], "--model-tag"),
    (["--model_tag", "a/b"], "--model-tag"), (["--step", "-1"], "--step"), (["--step", "last"], "--step")])
def test_bad_flags_are_rejected_by_parsing(argv, flag):
    from scripts import base_eval

    with pytest.raises(ValueError, match=re.escape(flag) + ": got"):
        base_eval.parse_config(argv)


def test_a_wrong_step_stops_before_the_core_data_is_read(tmp_path, monkeypatch):
    """--eval core with a --step that does not exist read every CORE file (seconds; minutes on a
    slow disk) before load_model said so: the checkpoint is now checked first."""
    from nanochat.errors import RequestError
    from scripts import base_eval

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    (tmp_path / "checkpoints" / "base" / "d4").mkdir(parents=True)
    read = []
    monkeypatch.setattr(core_eval, "load_core_data", lambda **kw: read.append(kw) or pytest.fail("data read"))
    with pytest.raises(RequestError, match="step 7"):
        base_eval.main(["--eval", "core", "--step", "7", "--device", "cpu"])
    assert read == []
