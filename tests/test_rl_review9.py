"""Review 9 of RL (scripts/chat_rl.py, nanochat/rl.py, GSM8K rewards):

* chat_rl accepted --top-k 1 and a --temperature below the sampler's greedy cut (GREEDY_BELOW):
  both sample greedily, so every sample of a group is the same, every advantage 0, and the run
  trained nothing while looking normal (as --num-samples 1 would, which is refused).
* GSM8K's extract_answer dropped every comma of a completion's answer: a decimal comma "#### 2,5"
  read as 25 and a list "#### 1,2" as 12, each rewarded against a gold 25 / 12. A comma now counts
  only between groups of three digits; the dataset's gold answers still drop any comma.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("argv, flag, accepted", [
    (["--top-k", "1"], "--top-k", "0 (off) or an integer >= 2"),
    (["--temperature", "1e-6"], "--temperature", "a finite number >= 1e-05"),
])
def test_greedy_rollout_flags_are_refused_by_name(argv, flag, accepted):
    from scripts.chat_rl import parse_config
    import re
    with pytest.raises(ValueError, match=f"^{flag}: got .*; accepted: {re.escape(accepted)}"):
        parse_config(argv)


def test_the_smallest_sampling_flags_that_still_draw_differently_are_accepted():
    from nanochat.sampling import GREEDY_BELOW, is_greedy
    from scripts.chat_rl import parse_config
    cfg = parse_config(["--top-k", "2", "--temperature", str(GREEDY_BELOW)])
    assert cfg.top_k == 2 and not is_greedy(cfg.temperature)
    assert parse_config(["--top-k", "0"]).top_k == 0   # 0: off (every token), not greedy


@pytest.mark.parametrize("completion, gold", [
    ("#### 2,5", "25"), ("#### 1,2", "12"), ("#### 12,34,5", "12345"), ("#### 1,000,00", "100000"),
    ("#### 1234,567", "1234567"),
])
def test_a_comma_outside_thousands_groups_earns_no_reward(completion, gold):
    from nanochat.tasks.gsm8k import GSM8K, extract_answer
    assert extract_answer(completion) is None
    assert GSM8K.__new__(GSM8K).reward({"answer": gold}, completion) == 0.0


@pytest.mark.parametrize("completion, gold", [
    ("#### 1,250", "1250"), ("#### $1,450,000.", "1450000"), ("#### -$2,125.50", "-2125.5"),
    ("#### 42, so that is it", "42"), ("#### 0.5", ".5"), ("#### 7,000 km", "7000"),
])
def test_thousands_commas_negatives_and_decimals_still_score(completion, gold):
    from nanochat.tasks.gsm8k import GSM8K
    assert GSM8K.__new__(GSM8K).reward({"answer": gold}, completion) == 1.0


def test_a_gold_answer_keeps_reading_any_comma():
    """The dataset's text is trusted: a row whose gold is written "1,2345" is not refused at load."""
    from nanochat.tasks.gsm8k import GSM8K, check_row, extract_answer
    row = {"question": "How many?", "answer": "Add them.\n#### 1,2345"}
    assert check_row(row) is None and extract_answer(row["answer"], gold=True) == "12345"
    conv = {"messages": [{"role": "assistant", "content": row["answer"]}]}   # no "answer" key: read from the text
    assert GSM8K.__new__(GSM8K).reward(conv, "#### 12345") == 1.0
