"""The whole-model GPU checks' common run (imported by the *_gpu tests): a model's greedy decode on HF's modules
eagerly (dispatch dropless, the reference), then the same model captured per bucket on a strategy and dispatcher and
decoded again, teacher-forced with the reference's tokens unless told otherwise; 3 prompts of 9 tokens, 16 new ones,
buckets 1, 2, 4, 8 (3 real rows in bucket 4), a 64-slot cache."""
from dataclasses import dataclass

import torch

from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine

NEW_TOKENS, BUCKETS, CACHE = 16, (1, 2, 4, 8), 64


def prompts_for(model) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))


def hf_reference(model, prompts):
    """HF's modules eagerly, dispatch dropless -> (the run with its logits, the counters' snapshot)."""
    attach(model, make_dispatcher("dropless"), max_rows=8)
    try:
        run = DecodeEngine(model, CACHE, 8).generate(prompts, NEW_TOKENS, keep_logits=True, timing=False)
        return run, state_of(model).snapshot()
    finally:
        detach(model)


@dataclass
class Forced:
    run: object  # the captured decode (tokens, logits)
    state: dict  # its counters' snapshot
    agreement: float  # of its greedy tokens with the reference's
    max_logit_diff: float
    stats: dict  # Capture.stats() after the decode


def captured_run(model, prompts, reference, strategy: str = "full", dispatch: str = "fused", kernels: str = "fused",
                 forced: bool = True) -> Forced:
    """The model captured on `strategy` with `dispatch` attached (capture.kernels=`kernels`; fused: on the Triton
    backend) and decoded, teacher-forced with the reference's tokens (forced) or free-running; unwrapped and detached
    after."""
    attach(model, make_dispatcher(dispatch), max_rows=8)
    try:
        eng = DecodeEngine(model, CACHE, 8)
        cap = Capture(eng, strategy, buckets=BUCKETS, kernels=kernels).apply()
        assert cap.captured and (kernels != "fused" or cap.stats()["kernel_backend"] == "triton")
        run = eng.generate(prompts, NEW_TOKENS, keep_logits=True, timing=False,
                           force_tokens=reference.tokens if forced else None)
        state, stats = state_of(model).snapshot(), cap.stats()
        cap.unwrap()
    finally:
        detach(model)
    agree = float((run.tokens == reference.tokens).float().mean())
    diff = max(float((a - c).abs().max()) for a, c in zip(run.logits, reference.logits))
    return Forced(run, state, agree, diff, stats)
