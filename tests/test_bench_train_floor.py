"""scripts/bench_train_floor.py on CPU: the floor runs exactly the model's matmuls, covers every
lm_head row, and bad flags raise naming the flag (the timings are a benchmark, not a test)."""

import pytest
import torch

from nanochat.gpt import GPT, config_for_depth
from scripts import bench_train_floor as BF


def tiny_floor(tokens=96, batch=2):
    cfg = config_for_depth(2, 200, tokens // batch)
    with torch.device("meta"):
        model = GPT(cfg)
    return model, BF.Floor(model, tokens, batch, "sdpa", torch.device("cpu"), torch.float32)


def test_floor_runs_the_models_matmul_flops():
    model, floor = tiny_floor()
    assert floor.matmul_flops() == 6 * model.num_scaling_params() * floor.M
    # every matrix of every block: q, k, v, attention out, MLP in/out (+ value-embedding gates)
    assert all(len(layer) >= 6 for layer in BF.block_shapes(model))


def test_lm_head_chunks_cover_every_row(monkeypatch):
    monkeypatch.setattr(BF, "LM_HEAD_CHUNK", 40)  # 96 rows: chunks of 40, 40, 16
    _, floor = tiny_floor()
    floor.run("gemm")
    x = floor.act[floor.head.size(1)]
    dl = torch.cat([floor.dlogits, floor.dlogits, floor.dlogits[:16]])
    torch.testing.assert_close(floor.head_grad, dl.t() @ x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(floor.out[floor.head.size(1)][80:], floor.dlogits[:16] @ floor.head)


def test_main_prints_a_row_per_part(capsys):
    rows = BF.main(["--device", "cpu", "--depth", "1", "--device-batch-size", "1", "--seq", "32",
                    "--vocab-size", "64", "--seconds", "0", "--warmup", "0", "--parts", "all"])
    assert [r["part"] for r in rows] == list(BF.PARTS)
    assert all(r["micro_batches"] >= 1 and r["ms_median"] > 0 and r["tokens"] == 32 for r in rows)
    assert capsys.readouterr().out.count('"part"') == 3


@pytest.mark.parametrize("flags, name", [(["--parts", "loss"], "--parts"), (["--seconds", "-1"], "--seconds"),
                                         (["--depth", "0"], "--depth"), (["--seq", "4"], "--seq")])
def test_bad_flags_raise_naming_the_flag(flags, name):
    with pytest.raises(ValueError, match=name):
        BF.main(flags)
