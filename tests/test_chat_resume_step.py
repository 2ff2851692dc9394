"""A chat stage's explicit --resume with a --step of the source other than the one the resumed run
started from: refused by name (it was silently ignored)."""

import pytest

from nanochat import checkpoint as ck
from tests.test_chat_train import BASE, CHAT


@pytest.mark.slow
def test_resume_with_another_source_step_is_refused_by_name(env, base_dir):
    from scripts import base_train, mid_train

    base_train.main(BASE + env + ["--model-tag", "steps", "--num-iterations", "4", "--eval-every", "-1",
                                  "--save-every", "2"])
    mid_args = [*CHAT, "--model-tag", "steps", "--num-iterations", "2", "--eval-every", "-1", "--save-every", "1"]
    mid_train.main(mid_args + ["--step", "2", "--num-iterations", "1"])   # a run from base step 2, stopped at 1
    assert ck.read_meta(ck.checkpoint_dir("mid", "steps"))["source"]["step"] == 2
    with pytest.raises(ck.CheckpointError, match=r"--step 4: the run --resume latest continues started from "
                                                 r"base/steps step 2.*accepted: --step 2 or no --step"):
        mid_train.main(mid_args + ["--resume", "latest", "--step", "4"])
    resumed = mid_train.main(mid_args + ["--resume", "latest", "--step", "2"])   # the same step: continues
    assert sorted(resumed["losses"]) == [1]
