"""Output quality on real text: teacher-forced bits per byte of the shipped held-out stdlib source.

Dims: B windows per forward, S window length (seq_len), N bytes, V vocab (256), L MoE layers, E experts.
Runs the model as it is, with whatever dispatcher `moecg.dispatch.attach` put in, so a capacity dispatcher's
dropped tokens show up as a higher bpb. Only byte-level models (vocab 256, one token per byte) make sense here.

Windowing: the text is cut into non-overlapping windows of S+1 bytes that share their edge byte
(window i is bytes [i*S, i*S + S]); the model reads the first S bytes and is scored on the last S. So every
byte but the first is scored exactly once, each with 0..S-1 bytes of context from its own window only
(context resets at window starts). A last, shorter window scores the remainder in its own forward.
bpb = (sum of -ln p(byte)) / (N - 1) / ln 2. A dispatcher that sizes per forward (capacity: C from T = B*S
tokens) sees the windows in groups of `batch_size`, so report `batch_size` with capacity numbers.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moecg.data import heldout_bytes
from moecg.dispatch import attach, detach, make_dispatcher, state_of

__all__ = ["heldout_bpb", "heldout_expert_load", "heldout_prompts", "as_byte_tensor"]


def as_byte_tensor(data: bytes | bytearray | torch.Tensor | None, max_bytes: int | None = None) -> torch.Tensor:
    """[N] int64 byte ids from bytes or a 1-D tensor; None means the shipped held-out text."""
    if data is None:
        data = heldout_bytes()
    if isinstance(data, (bytes, bytearray)):
        data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if data.dim() != 1:
        raise ValueError(f"data has shape {tuple(data.shape)}: pass 1-D bytes or a 1-D tensor of byte ids")
    return data[:max_bytes].long()


def _windows(ids: torch.Tensor, seq_len: int):
    """(inputs [W, S], targets [W, S]) full windows, then (inputs [1, R], targets [1, R]) for the tail or None."""
    n_full = (ids.numel() - 1) // seq_len
    body = ids[: n_full * seq_len + 1]
    x = body[:-1].view(n_full, seq_len)  # [W, S]
    y = body[1:].view(n_full, seq_len)  # [W, S]
    tail = ids[n_full * seq_len:]
    return x, y, (tail[None, :-1], tail[None, 1:]) if tail.numel() >= 2 else None


@torch.inference_mode()
def heldout_bpb(model, data: bytes | torch.Tensor | None = None, seq_len: int = 256, max_bytes: int | None = None,
                batch_size: int = 16) -> float:
    """Teacher-forced bits per byte of `data` (default: the shipped held-out text), windowed as above."""
    ids = as_byte_tensor(data, max_bytes)
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 bytes to score, got {ids.numel()}")
    vocab = model.config.vocab_size
    if vocab < 256:
        raise ValueError(f"model vocab_size={vocab}: bpb needs a byte-level model (vocab_size=256)")
    device = next(model.parameters()).device
    x, y, tail = _windows(ids, seq_len)
    batches = [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, x.shape[0], batch_size)]
    if tail is not None:
        batches.append(tail)
    nll = torch.zeros((), dtype=torch.float64, device=device)
    for xb, yb in batches:
        logits = model(input_ids=xb.to(device), use_cache=False).logits  # [B, S, V]
        # fp32 log-softmax: bf16 logits lose ~0.01 bpb in the normaliser alone
        nll += F.cross_entropy(logits.float().flatten(0, 1), yb.to(device).flatten(), reduction="sum").double()
    return float(nll) / (ids.numel() - 1) / math.log(2)


@torch.inference_mode()
def heldout_expert_load(model, data: bytes | torch.Tensor | None = None, seq_len: int = 256,
                        max_bytes: int | None = None, batch_size: int = 16) -> dict:
    """Expert load on held-out text: {'expert_load_imbalance': mean over layers of max/mean load, ...}.

    Counts through the attached dispatcher (its counters are saved and restored around the run), or through
    `dynamic`, HF's own experts loop, attached for the run when none is.
    """
    state = state_of(model)
    attached_here = state is None
    if attached_here:
        state = attach(model, make_dispatcher("dynamic"))
    saved, counting = state.save(), state.counting
    try:
        state.reset()
        state.counting = True
        bpb = heldout_bpb(model, data, seq_len, max_bytes, batch_size)
        snap = state.snapshot()
    finally:
        if attached_here:
            detach(model)
        else:
            state.restore(saved)
            state.counting = counting
    return {"bpb": bpb, "expert_load_imbalance": snap["expert_load_imbalance"],
            "per_layer_load_imbalance": snap["per_layer_load_imbalance"], "drop_rate": snap["drop_rate"]}


def heldout_prompts(batch_size: int, prompt_len: int, seed: int = 0) -> torch.Tensor:
    """[B, S] int64 prompts: byte windows of the shipped held-out text, each starting at a line start.

    Seeded and independent of the machine, so decode measurements on real text see the same prompts everywhere.
    """
    ids = as_byte_tensor(None)
    if prompt_len < 1 or prompt_len >= ids.numel():
        raise ValueError(f"prompt_len={prompt_len}: must be in [1, {ids.numel() - 1}] (held-out text size)")
    starts = (ids[:-1] == ord("\n")).nonzero().squeeze(1) + 1  # [lines]
    starts = starts[starts + prompt_len <= ids.numel()]
    gen = torch.Generator().manual_seed(seed)
    pick = starts[torch.randint(starts.numel(), (batch_size,), generator=gen)]  # [B]
    return ids[pick[:, None] + torch.arange(prompt_len)]  # [B, S]
