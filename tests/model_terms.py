"""Random values for the terms HF initialises to zero or one, so a fused path that drops one shows in its logits.

Imported by the fused-step tests (CPU and GPU): biases and attention sinks ~ N(0, 0.5^2), DeepSeek/GLM's
e_score_correction_bias ~ U(0, 0.3), and with norms=True every `layernorm` weight ~ 1 + N(0, 0.5^2); drawn in
parameter order from one generator on the model's device, seeded by `seed`.
"""
import torch


@torch.no_grad()
def randomise_terms(model, seed: int = 0, norms: bool = False):
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in model.named_parameters():
        norm = norms and "layernorm" in name
        if name.endswith("bias") or name.endswith("sinks") or norm:
            p.copy_(torch.randn(p.shape, device=dev, generator=g) * 0.5 + (1.0 if norm else 0.0))
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.rand(buf.shape, device=dev, generator=g) * 0.3)
    return model
