"""Review 6 of the inference-side transforms and decode steps (nanochat/quantize.py,
nanochat/triton_int8.py, nanochat/decode.py, scripts/bench_inference.py, scripts/chat_cli.py):
each test failed before its fix."""

import json

import pytest


def test_bf16_int8_layer_under_the_interpreter_matches_the_dequantising_path(run_triton_interpreted):
    """Under TRITON_INTERPRET=1 a quantised layer picks the Triton product; the interpreter turns an
    int8 -> bf16 cast into inf/NaN and a bf16 tl.dot into garbage, so a bf16 model's decode rows
    (2..GEMV_MAX_ROWS of them) came out ~1e9 off. bf16 inputs now take the dequantising path there;
    float32 ones still run the kernel."""
    run_triton_interpreted("""
import torch
from tests.test_quantize import tiny_model
from nanochat.quantize import quantize_model, int8_linear
model = quantize_model(tiny_model(depth=1, vocab=128, seq=96).to(torch.bfloat16), "int8")
lin = model.blocks[0].mlp.c_fc
assert lin.kernel is not None
for rows in (1, 3):
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, lin.in_features).to(dtype)
        got, want = lin(x).float(), int8_linear(x, lin.qweight, lin.scale, kernel=None).float()
        assert got.dtype == want.dtype and (got - want).abs().max() <= 0.02 * want.abs().max(), (rows, dtype)
print("OK")
""")


def _bench_rows(capsys, argv):
    from scripts.bench_inference import main

    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_bench_inference_int8_rows_are_never_labelled_unfused(capsys):
    """An int8 model's q/k/v is one fused product whatever Engine(fused_qkv=False) says (attention
    runs qkv_quant whenever grad is off), so `--quantize none,int8 --fused-qkv on,off` printed an
    'eager/unfused+int8' row that ran fused. The int8 runs now skip 'off', and an int8 run with
    'off' alone is refused before the model is built, naming the flag."""
    from scripts.bench_inference import parse_args

    rows = _bench_rows(capsys, ["--device", "cpu", "--depth", "2", "--prompt-len", "8", "--decode-tokens", "2",
                                "--batch-sizes", "1", "--vocab-size", "128", "--seq-len", "32", "--decode", "eager",
                                "--quantize", "none,int8", "--fused-qkv", "on,off", "--repeats", "1"])
    decode = sorted(r["decode"] for r in rows if r.get("bench") == "decode")
    assert decode == ["eager", "eager+int8", "eager/unfused"], decode
    with pytest.raises(ValueError, match=r"^--fused-qkv off: .*accepted with --quantize int8: --fused-qkv on"):
        parse_args(["--device", "cpu", "--quantize", "int8", "--fused-qkv", "off"])
