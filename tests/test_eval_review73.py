"""Evaluation correctness review 73: scored text as the reference definitions write it."""

from __future__ import annotations

import json
import re

from nanochat import core_data

# a context ending in a sentence start written lower case: "... roof. he", "two men"
_OPEN_LOWER = re.compile(r"(?:^|[.!?]\s+)[a-z][^.!?]*$")


def test_offline_hellaswag_capitalises_the_open_sentence_of_its_context(tmp_path, shared_data):
    """ActivityNet's HellaSwag items (a third of the set) end in the first words of the sentence the
    endings finish, lower case in the data (ctx_b: "A man is sitting on a roof. he"). lm-eval and the
    DCLM bundle score "Roof shingle removal: A man is sitting on a roof. He" + " starts pulling ...";
    the offline items kept "he", a sentence start no prose writes, before every choice."""
    rows = [{"activity_label": "Roof shingle removal", "ctx": "A man is sitting on a roof. he",
             "endings": ["is using wrap to wrap a pair of skis.", "starts pulling up roofing on a roof."], "label": 1},
            {"activity_label": "Sumo", "ctx": "two men", "endings": ["fight.", "bow."], "label": 0},
            # a WikiHow context ends in a whole sentence: nothing to capitalise
            {"activity_label": "Health", "ctx": "[header] How to rest [title] Sleep well. [step] lie down.",
             "endings": ["then rest.", "sleep."], "label": 0}]
    (tmp_path / "hellaswag.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = core_data.load_core_data(tasks=["hellaswag_zeroshot"], data_dir=tmp_path).tasks[0][1]
    assert [i["query"] for i in items] == ["Roof shingle removal: A man is sitting on a roof. He", "Sumo: Two men",
                                           "Health: How to rest. Sleep well. lie down."]
    # the endings continue that sentence: they keep their own case
    assert items[0]["choices"] == ["is using wrap to wrap a pair of skis.", "starts pulling up roofing on a roof."]
    # the shipped file: 3,236 of its 10,042 contexts ended so; none does now
    items = core_data.load_core_data(tasks=["hellaswag"], data_dir=shared_data / "eval").tasks[0][1]
    assert len(items) == 10042
    assert not [i["query"] for i in items if _OPEN_LOWER.search(i["query"].partition(": ")[2])]
