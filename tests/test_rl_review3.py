"""RL review 3 (scripts/chat_rl.py, nanochat/rl.py, nanochat/common.py): a malformed WORLD_SIZE is
named at flag validation (it was a ZeroDivisionError traceback or int()'s bare message), the
rank-strided sharding of a step's problems covers every problem exactly once per epoch for any
world size that divides --examples-per-step, and group advantages sum to zero (exactly zero for a
group of equal rewards). Fast: no model, no process group."""

from __future__ import annotations

import pytest

from nanochat.errors import RequestError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("world, said", [("0", r"WORLD_SIZE=0"), ("two", r"WORLD_SIZE must be integers.*'two'"),
                                         ("-2", r"WORLD_SIZE=-2")])
def test_a_malformed_world_size_is_named_at_flag_validation(monkeypatch, world, said):
    from scripts.chat_rl import parse_config
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(RequestError, match=said):
        parse_config(["--examples-per-step", "4"])


def test_world_size_from_env_is_checked_as_init_runtime_checks_it(monkeypatch):
    from nanochat.common import env_world_size
    assert env_world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RequestError, match="WORLD_SIZE=2 is set but RANK is not"):
        env_world_size()
    monkeypatch.setenv("RANK", "1")
    assert env_world_size() == 2


def test_examples_per_step_not_dividing_the_world_size_names_both(monkeypatch):
    from scripts.chat_rl import parse_config
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"--examples-per-step: got 6; accepted: a multiple of the world size 4"):
        parse_config(["--examples-per-step", "6"])
    assert parse_config(["--examples-per-step", "8"]).examples_per_step == 8


class _Rank:
    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


class _Problems:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def _shares(n_problems: int, per_step: int, world: int, steps: int) -> list[list[list[int]]]:
    """[step][rank] -> the problem indices that rank rolls out (PolicyGradientTrainer._my_problems)."""
    from nanochat.rl import PolicyGradientTrainer
    out = []
    for step in range(steps):
        row = []
        for rank in range(world):
            t = object.__new__(PolicyGradientTrainer)   # no Engine: only the sharding is under test
            t.task, t.rt, t.examples_per_step, t.pos = _Problems(n_problems), _Rank(rank, world), per_step, step * per_step
            row.append(t._my_problems())
        out.append(row)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 6])
def test_each_problem_is_rolled_out_once_per_epoch_whatever_the_world_size(world):
    """12 problems, 6 a step: 2 steps are an epoch; every rank gets 6/world problems a step, no
    problem twice and none left out, and a step's problems are the same set for 1 or `world` ranks;
    the next epoch starts again at problem 0."""
    shares = _shares(12, 6, world, 4)
    one = _shares(12, 6, 1, 4)
    for step, row in enumerate(shares):
        assert all(len(mine) == 6 // world for mine in row)
        flat = [i for mine in row for i in mine]
        assert sorted(flat) == sorted(one[step][0]) and len(set(flat)) == 6
    epoch = [i for row in shares[:2] for mine in row for i in mine]
    assert sorted(epoch) == list(range(12))
    assert sorted(i for row in shares[2:] for mine in row for i in mine) == list(range(12))


def test_group_advantages_sum_to_zero_and_are_zero_for_equal_rewards():
    from nanochat.rl import group_advantages
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 1.0])
    assert adv == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4]) and sum(adv) == pytest.approx(0.0, abs=1e-12)
    for equal in ([0.0] * 4, [1.0] * 4, [0.1] * 3, [0.7] * 16):
        assert group_advantages(equal) == [0.0] * len(equal)
    assert group_advantages([0.0, 0.0, 0.0, 1.0]) == pytest.approx([-0.25, -0.25, -0.25, 0.75])
