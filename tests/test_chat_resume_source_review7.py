"""A chat stage's explicit --resume of a run that started from another --source phase (here SFT
from base, resumed with SFT's default --source mid): refused by name. It went on with the
resumed weights but recorded the mid lineage, whose held-out test problems chat_eval then used."""

import pytest

from nanochat import checkpoint as ck
from tests.test_chat_train import BASE, CHAT


@pytest.mark.slow
def test_resume_under_another_source_phase_is_refused_by_name(env, base_dir):
    from scripts import base_train, chat_sft, mid_train

    base_train.main(BASE + env + ["--model-tag", "src", "--num-iterations", "2", "--eval-every", "-1"])
    chat = [*CHAT, "--model-tag", "src", "--eval-every", "-1", "--save-every", "1"]
    mid_train.main(chat + ["--num-iterations", "1"])    # a mid checkpoint: SFT's default source exists
    chat_sft.main(chat + ["--source", "base", "--num-iterations", "1"])   # an SFT run from base
    assert ck.read_meta(ck.checkpoint_dir("sft", "src"))["source"]["phase"] == "base"
    with pytest.raises(ck.CheckpointError, match=r"--source mid: the run --resume latest continues started from "
                                                 r"--source base .*accepted: --source base"):
        chat_sft.main(chat + ["--num-iterations", "2", "--resume", "latest"])
    resumed = chat_sft.main(chat + ["--num-iterations", "2", "--resume", "latest", "--source", "base"])
    assert sorted(resumed["losses"]) == [1]
    assert ck.read_meta(ck.checkpoint_dir("sft", "src"))["source"]["phase"] == "base"
