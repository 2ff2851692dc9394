"""The default GB10 run (--kernel current, compiled: inductor's kernels are Triton's) with no ptxas
that can target sm_121 is refused by the recipes' early kernel check, naming --no-compile, before the
checkpoint directory, data and model exist (it stopped in training's apply_patches after them)."""

import pytest

from nanochat.platform import PtxasMissing
from tests.test_gb10_review10 import GB10, H100, old_triton  # noqa: F401  (old_triton: a fixture)


def test_compiled_current_kernel_without_a_ptxas_is_refused_early(old_triton):  # noqa: F811
    from nanochat.kernels import check_kernel
    old_triton(GB10)
    with pytest.raises(PtxasMissing, match=r"^the compiled model \(--no-compile avoids it\): Triton 3\.5\.1's "
                                           r"bundled ptxas"):
        check_kernel("current", "cuda", compile=True)
    check_kernel("current", "cuda")          # eager plain torch: no Triton kernel, nothing to refuse
    old_triton(H100)
    check_kernel("current", "cuda", compile=True)   # sm_90: the bundled ptxas serves it


def test_base_train_checks_the_compiled_kernel_before_claiming_the_checkpoint_dir():
    """base_train's order: the checks (compile resolved first) before claim_checkpoint_dir."""
    import scripts.base_train as bt

    src = open(bt.__file__).read()
    body = src[src.index("def train(cfg: BaseTrainConfig, rt)"):]
    assert body.index("compile_model = ") < body.index("check_kernel(cfg.kernel, rt.device, compile=compile_model)") \
        < body.index("claim_checkpoint_dir(ckpt_dir)")
