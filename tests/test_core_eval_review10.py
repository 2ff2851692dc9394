"""CORE review 10: base_eval's CORE used as a demanding user would, and scored items checked by hand.

Defects fixed (each test marked "was:" failed before its fix):
* core_data.resolve_sources: a default bundle dir (<base dir>/eval_bundle) holding files but no
  core.yaml (the zip unpacked one level too deep: eval_bundle/eval_bundle/core.yaml) fell back to
  the offline files silently: a CORE of other prompts, labelled only by its source string.
* core_eval.evaluate_task: num_items=-1 (base_eval's "all") or 0 returned accuracy 0.0 over no
  items, and a scoring other than "mean" (a typo) silently ranked choices by their summed NLL.
The hand-computation test guards the scorer: a tiny real GPT, every sequence scored alone with
log_softmax, the item decided by upstream's rules, against evaluate_task's batched verdicts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanochat import core_data
from nanochat.core_eval import CoreTask, evaluate_task, fewshot_indices
from nanochat.errors import MissingDataError
from tests.test_eval_edge import ByteTok

MC = CoreTask("mc", "multiple_choice", 2, 0.25, "\nAnswer: ")
SC = CoreTask("sc", "schema", 1, 0.5, " ")
LM = CoreTask("lm", "language_modeling", 2, 0.0, " ")


# ------------------------------------------------------------------ a misplaced bundle

@pytest.fixture
def no_bundle_env(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.delenv("NANOCHAT_EVAL_BUNDLE", raising=False)
    return tmp_path / "base" / "eval_bundle"


def test_bundle_unzipped_one_level_too_deep_is_an_error_not_offline(no_bundle_env, shared_data):
    """was: resolve_sources returned the offline files ("offline:..."), and the CORE printed was theirs."""
    nested = no_bundle_env / "eval_bundle"
    nested.mkdir(parents=True)
    (nested / "core.yaml").write_text("icl_tasks: []\n")
    with pytest.raises(MissingDataError) as e:
        core_data.resolve_sources(data_dir=shared_data / "eval")
    msg = str(e.value)
    assert str(nested / "core.yaml") in msg and "download_eval_bundle" in msg and "offline" in msg


def test_default_bundle_dir_with_other_files_is_an_error(no_bundle_env, shared_data):
    """was: offline fallback. A partly copied bundle (eval_data/ only) names the folder."""
    (no_bundle_env / "eval_data").mkdir(parents=True)
    with pytest.raises(MissingDataError, match="holds files but no core.yaml"):
        core_data.load_core_data(data_dir=shared_data / "eval")


def test_absent_or_empty_default_bundle_dir_still_uses_offline_files(no_bundle_env, shared_data):
    assert core_data.resolve_sources(data_dir=shared_data / "eval")[1].startswith("offline:")
    no_bundle_env.mkdir(parents=True)   # download_eval_bundle accepts an empty dest too
    assert core_data.resolve_sources(data_dir=shared_data / "eval")[1].startswith("offline:")


# ------------------------------------------------------------------ evaluate_task's own arguments

def test_evaluate_task_rejects_num_items_that_select_nothing():
    """was: 0.0 returned for -1 and 0 (no item scored), as if the model had got every one wrong."""
    model, items = tiny_gpt(), lm_items()
    for bad in (-1, 0, True, 2.5):
        with pytest.raises(ValueError, match="num_items.*accepted: None"):
            evaluate_task(model, ByteTok(), LM, items, "cpu", num_items=bad)


def test_evaluate_task_rejects_an_unknown_scoring():
    """was: any value but "mean" ranked the choices by summed NLL, silently."""
    with pytest.raises(ValueError, match="scoring: got 'Mean'; accepted: mean|sum"):
        evaluate_task(tiny_gpt(), ByteTok(), MC, mc_items(), "cpu", scoring="Mean")


# ------------------------------------------------------------------ scored items against a hand computation

def tiny_gpt(seed: int = 0):
    from nanochat.gpt import GPT, GPTConfig

    cfg = GPTConfig(sequence_len=512, vocab_size=257, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                    window_pattern="L")
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.init_weights()
    with torch.no_grad():   # init zeroes the output projections: spread the choices' scores apart
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def mc_items():
    qs = [("Sky colour?", ["blue", "green", "red"], 0), ("Two plus two?", ["three", "four", "five"], 1),
          ("Cat sound?", ["woof", "moo", "meow"], 2), ("Ice is?", ["cold", "hot", "loud"], 0),
          ("Sun rises in the?", ["west", "east", "north"], 1), ("Fish live in?", ["trees", "sand", "water"], 2)]
    return [{"query": q, "choices": c, "gold": g} for q, c, g in qs]


def sc_items():
    pairs = [("The cup fell off the table because the", ["cup", "table"], "was too near the edge."),
             ("Anna thanked Mary because", ["Anna", "Mary"], "had helped her."),
             ("The box did not fit in the car because the", ["box", "car"], "was too big."),
             ("Tom called Sam because", ["Tom", "Sam"], "wanted to talk.")]
    return [{"context_options": [f"{c} {o}" for o in opts], "continuation": k, "gold": i % 2}
            for i, (c, opts, k) in enumerate(pairs)]


def lm_items():
    return [{"context": f"Count: {' '.join('ab'[:i % 2 + 1] * j for j in range(3))}  ", "continuation": w}
            for i, w in enumerate(["one", "two", "three", "four", "five"])]


def hand_scores(model, ids: list[int], start: int) -> tuple[float, bool]:
    """(mean NLL of ids[start:], greedy exact match), the sequence alone in its batch."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].double()
    logp = F.log_softmax(logits, -1)
    nll = [-logp[p - 1, ids[p]].item() for p in range(start, len(ids))]
    exact = all(logits[p - 1].argmax().item() == ids[p] for p in range(start, len(ids)))
    return sum(nll) / len(nll), exact


def common_prefix(seqs):
    n = 0
    while all(len(s) > n for s in seqs) and len({s[n] for s in seqs}) == 1:
        n += 1
    return n


def hand_correct(model, task: CoreTask, item: dict, shots: list[dict]) -> bool:
    """Upstream nanochat's rendering and rules, written out plainly: text in, ByteTok ids (bytes)."""
    enc, d = (lambda text: [256] + list(text.encode())), task.continuation_delimiter
    if task.task_type == "multiple_choice":
        prefix = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}\n\n" for s in shots)
        fulls = [enc(prefix + item["query"] + d + c) for c in item["choices"]]
        start = common_prefix(fulls)   # the choices share no first letter here
        means = [hand_scores(model, f, start)[0] for f in fulls]
    elif task.task_type == "schema":
        prefix = "".join(f"{s['context_options'][s['gold']]}{d}{s['continuation']}\n\n" for s in shots)
        fulls = [enc(prefix + o + d + item["continuation"]) for o in item["context_options"]]
        suffix = common_prefix([f[::-1] for f in fulls])
        means = [hand_scores(model, f, len(f) - suffix)[0] for f in fulls]
    else:
        prefix = "".join(f"{s['context'].strip()}{d}{s['continuation']}\n\n" for s in shots)
        context = prefix + item["context"].strip() + d.rstrip()
        return hand_scores(model, enc(context + d[len(d.rstrip()):] + item["continuation"]), len(enc(context)))[1]
    return min(range(len(means)), key=means.__getitem__) == item["gold"]


@pytest.mark.parametrize("task,items", [(MC, mc_items()), (SC, sc_items()), (LM, lm_items())],
                         ids=["multiple_choice", "schema", "language_modeling"])
def test_scored_items_match_a_hand_computation(task, items):
    model = tiny_gpt()
    hand = []
    for i, item in enumerate(items):
        shots = [items[j] for j in fewshot_indices(i, len(items), task.num_fewshot)]
        hand.append(hand_correct(model, task, item, shots))
    if task.task_type == "language_modeling":   # a random model reproduces no word: make one item exact
        assert hand == [False] * len(items)
    else:   # the tiny model gets some right and some wrong: the comparison can fail
        assert 0 < sum(hand) < len(items), hand
    # one item at a time, then all in one batch (right padding, several lengths)
    single = evaluate_task(model, ByteTok(), task, items, "cpu", batch_tokens=1)
    batched = evaluate_task(model, ByteTok(), task, items, "cpu", batch_tokens=1 << 16)
    assert single == batched == pytest.approx(sum(hand) / len(items))
