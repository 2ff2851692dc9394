"""Evaluation review 11: CORE scored as a researcher publishing the numbers would need it.

Defect fixed (the tests marked "was:" failed before the fix):
* core_eval._crop: a CORE sequence longer than the model's sequence_len kept its newest
  sequence_len tokens, so it began mid-text with no BOS, a start no training row ever has
  (BOS-aligned packing puts a BOS at position 0 of every row; chat_eval's over-long prompts keep
  theirs). Offline 10-shot squad at 2048 tokens is cut on most items, boolq on some. Now the BOS
  stays and the tokens after it go; which answer tokens are scored (and when an answer counts as
  cut) is unchanged.
Scripted tokenizer and models; CPU; well under a second.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from nanochat.core_eval import CoreTask, evaluate_task, render_prompts, tokenize_items

BOS = 256
LM = CoreTask("lm", "language_modeling", 0, 0.0, " ")
MC = CoreTask("mc", "multiple_choice", 0, 0.5, " ")
SC = CoreTask("sc", "schema", 0, 0.5, " ")


class Bytes:
    """One token per UTF-8 byte; BOS is 256."""

    bos_token_id = BOS

    def encode(self, text, prepend=None):
        if isinstance(text, list):
            return [self.encode(t, prepend) for t in text]
        return ([prepend] if prepend is not None else []) + list(text.encode())


class SeesBos(nn.Module):
    """Predicts 'a' at every position of a row that starts with BOS, 'b' in any other row (a
    model whose every prediction depends on the start of its window, as an attention sink's do)."""

    def __init__(self, seq_len: int):
        super().__init__()
        self.config = type("Cfg", (), {"sequence_len": seq_len})()

    def forward(self, idx, targets=None):
        B, T = idx.shape
        logits = torch.zeros(B, T, 257)
        favourite = torch.where(idx[:, :1] == BOS, ord("a"), ord("b")).expand(B, T)
        logits.scatter_(2, favourite.unsqueeze(-1), 10.0)
        return logits


def test_a_cropped_sequence_keeps_its_bos_and_its_newest_tokens():
    """was: ids == full[-16:] (no BOS)."""
    tok = Bytes()
    ctx, cont = render_prompts(LM, {"context": "x" * 40, "continuation": "tail"}, [])
    full = tok.encode(ctx[0] + cont[0], prepend=BOS)
    cut: list[bool] = []
    (ids, start), = tokenize_items(tok, LM, [(ctx, cont)], 16, cut)[0]
    assert len(full) > 16 and ids == [BOS] + full[-15:]
    assert bytes(ids[start:]).decode() == " tail" and cut == [False]


def test_every_task_type_keeps_the_bos_and_scores_the_same_answer_tokens():
    tok = Bytes()
    long = "word " * 30
    cases = [(MC, ([long + "q"] * 2, [" yes", " no way"])),
             (SC, ([long + "the cup", long + "the big ball"], [" fits."] * 2)),
             (LM, ([long + "q"], [" answer"]))]
    for task, (ctx, cont) in cases:
        cut: list[bool] = []
        seqs = tokenize_items(tok, task, [(ctx, cont)], 24, cut)[0]
        roomy = tokenize_items(tok, task, [(ctx, cont)], 10_000)[0]
        for (ids, start), (whole, whole_start) in zip(seqs, roomy):
            assert ids[0] == BOS and len(ids) == 24, task.label
            assert ids[1:] == whole[-23:], task.label                       # the newest tokens after BOS
            assert ids[start:] == whole[whole_start:], task.label           # the same scored tokens
        assert cut == [False], task.label


def test_an_answer_longer_than_the_window_is_still_flagged_cut():
    tok = Bytes()
    # BOS + "x" + " " + 17 bytes = 20 tokens, 18 of them scored: they fit in 19 (BOS + 18), not in 18
    for max_len, lost in ((20, False), (19, False), (18, True), (8, True)):
        cut: list[bool] = []
        (ids, start), = tokenize_items(tok, LM, [(["x"], [" " + "a" * 17])], max_len, cut)[0]
        assert cut == [lost] and ids[0] == BOS and len(ids) == min(20, max_len) and start >= 1
        if not lost:
            assert bytes(ids[start:]).decode() == " " + "a" * 17


def test_a_model_that_needs_its_bos_scores_cropped_items_as_uncropped_ones():
    """was: 0.0 at max_seq_len 32 (the cropped rows began with 'x', no BOS), 1.0 with room."""
    items = [{"context": "x" * 60 + str(i), "continuation": "aaa"} for i in range(3)]
    lm = CoreTask("lm", "language_modeling", 0, 0.0, "")   # no delimiter: every scored token is an 'a'
    for max_len in (32, 128):
        assert evaluate_task(SeesBos(max_len), Bytes(), lm, items, "cpu", max_seq_len=max_len) == 1.0, max_len
    mc = [{"query": "x" * 60 + str(i), "choices": ["aaaa", "bbbb"], "gold": 0} for i in range(3)]
    assert evaluate_task(SeesBos(32), Bytes(), MC, mc, "cpu", max_seq_len=32) == 1.0
