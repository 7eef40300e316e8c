"""What the Triton-interpreter scripts (tests/triton_interp_*.py, run by their test files as subprocesses under
TRITON_INTERPRET=1; not collected by pytest: no test_ prefix) share, with the GPU tests where they check the same: the
closeness check, a producer's quantized output against act_quant, and the whole-model comparison of the fused decode
step with the Triton ops against the same step with the torch ops."""
import torch

from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine
from moecg.fast import FastDecode
from moecg.models.formats import act_quant


def close(a, b, tol=1e-5):
    err = float((a.float() - b.float()).abs().max())
    assert err <= tol, err


def same_quant(got, x):
    """got, a kernel's (e4m3 values, fp32 scales) of x, is act_quant(x) bit for bit (the values compared as bytes: -0
    and +0 differ)."""
    q, s = act_quant(x)
    assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[1], s)


def fused_backends_agree(model, prompts, cache_len: int, new_tokens: int, label: str = "") -> list[FastDecode]:
    """Greedy decode of `prompts` with the fused step and dispatch=fused, once on the torch ops and once on the
    Triton ops (fp32): the same tokens, logits within 1e-4, the same routed counters. Returns both FastDecodes."""
    runs, steps = [], []
    for backend in ("torch", "triton"):
        attach(model, make_dispatcher("fused", kernels=backend), max_rows=4)
        eng = DecodeEngine(model, cache_len, 4)
        eng.decode_forward = FastDecode(model, backend)
        steps.append(eng.decode_forward)
        runs.append((eng.generate(prompts, new_tokens, keep_logits=True, timing=False), state_of(model).snapshot()))
        detach(model)
    assert torch.equal(runs[0][0].tokens, runs[1][0].tokens), label
    close(torch.stack(runs[0][0].logits), torch.stack(runs[1][0].logits), 1e-4)
    assert runs[0][1]["routed"] == runs[1][1]["routed"], label
    return steps
