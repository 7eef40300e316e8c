"""fp8_dynamic activations in the Triton kernels on CPU: the K-step rule (act_k) and the kernels under the interpreter
(tests/triton_interp_act.py: every block-FP8 GEMM kernel with quantized inputs against the PyTorch reference, and
whole models' fused step on the Triton ops against the same step on the reference ops)."""

import pytest

from moecg.kernels.quant import act_k
from interp_runner import run_marked  # tests/


def test_a8_k_steps_cover_whole_scale_blocks():
    assert act_k(64, 16) == 128 and act_k(256, 16) == 128  # the tensor cores scale each 128-column MMA sum
    assert act_k(64, 1) == 128 and act_k(1024, 1) == 1024 and act_k(2048, 2) == 2048  # CUDA cores: whole blocks
    with pytest.raises(ValueError, match="BLOCK_K=96"):
        act_k(96, 1)


@pytest.mark.slow
@pytest.mark.interp("triton_interp_act.py", timeout=900)
def test_kernels_on_quantized_inputs_under_interpreter(request):
    run_marked(request)
