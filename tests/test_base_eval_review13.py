"""base_eval's bpb read the default <base dir>/base_data even for a checkpoint trained with
`base_train --data-dir X`: "no text shards" (or another corpus's bpb) unless --data-dir was given
again. It now defaults to the checkpoint's own --data-dir while that folder exists."""
from scripts import base_eval


def _meta(data_dir):
    return {"config": {"data_dir": data_dir}, "model_config": {"sequence_len": 64}}


def test_bpb_uses_the_checkpoints_data_dir(tmp_path, monkeypatch, capsys):
    import nanochat.dataloader as dataloader
    import nanochat.tokenizer as tokenizer

    class Tok:
        fingerprint = None

    made = []
    monkeypatch.setattr(tokenizer, "get_tokenizer", lambda base_dir: Tok())
    monkeypatch.setattr(dataloader, "DataLoader", lambda *a, **kw: made.append(kw["data_dir"]) or "loader")

    class Rt:
        device, rank, world_size = "cpu", 0, 1

    cfg = base_eval.parse_config(["--eval", "bpb"])
    loaders = base_eval.bpb_loaders(cfg, Rt(), tmp_path, _meta(str(tmp_path)))
    assert set(loaders.values()) == {"loader"} and made and set(made) == {str(tmp_path)}
    assert "the checkpoint's --data-dir" in capsys.readouterr().out


def test_an_unusable_saved_data_dir_is_said(tmp_path, capsys):
    cfg = base_eval.parse_config(["--eval", "bpb"])
    assert base_eval.bpb_data_dir(cfg, _meta("shards")) is None
    assert "--data-dir shards, which is relative: bpb on <base dir>/base_data" in capsys.readouterr().out
    assert base_eval.bpb_data_dir(cfg, _meta(str(tmp_path / "gone"))) is None
    assert "which is gone" in capsys.readouterr().out


def test_bpb_data_dir_precedence(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    cfg = base_eval.parse_config(["--eval", "bpb", "--data-dir", str(other)])
    assert base_eval.bpb_data_dir(cfg, _meta(str(tmp_path))) == str(other)   # the flag wins
    cfg = base_eval.parse_config(["--eval", "bpb"])
    assert base_eval.bpb_data_dir(cfg, _meta(str(tmp_path / "gone"))) is None   # moved away: the default
    assert base_eval.bpb_data_dir(cfg, _meta(None)) is None
    assert base_eval.bpb_data_dir(cfg, {"config": "odd"}) is None
    assert base_eval.bpb_data_dir(cfg, _meta("relative/dir")) is None   # relative to base_train's cwd, unknown here


def test_a_chat_checkpoints_data_dir_is_not_read_as_shards(tmp_path):
    """mid/SFT/RL save --data-dir too, but theirs is the chat data's root (eval/ sft/ words/): read
    as pretraining shards it made `base_eval -i sft --eval bpb` fail with "no text shards"."""
    for source in ("mid", "sft", "rl"):
        cfg = base_eval.parse_config(["-i", source, "--eval", "bpb"])
        assert base_eval.bpb_data_dir(cfg, _meta(str(tmp_path))) is None


def test_base_train_saves_its_data_dir_absolute(tmp_path, monkeypatch):
    from scripts import base_train

    (tmp_path / "shards").mkdir()
    monkeypatch.chdir(tmp_path)
    assert base_train.parse_config(["--data-dir", "shards"]).data_dir == str(tmp_path / "shards")
