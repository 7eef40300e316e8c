"""Fidelity of a decode path against a reference: greedy agreement (free-running and teacher-forced), the
largest logit difference before a row first diverges, and top-1/top-2 margins (how close a flip was to a tie).

Dims: n rows, T decode steps, V vocab.
"""
from __future__ import annotations

import torch


def top2_margins(logits: list[torch.Tensor]) -> torch.Tensor:
    """Per-step logits [n, V] -> [n, steps]: top-1 minus top-2 logit, how close each greedy choice was to a tie."""
    return torch.stack([(lambda v: v[:, 0] - v[:, 1])(lg.topk(2, dim=-1).values) for lg in logits], 1)


def agreement(ref_tokens, free_tokens, forced_tokens, margins=None) -> tuple[float, float, float | None]:
    """(free-running agreement, teacher-forced agreement, largest reference margin where forced disagrees).

    Free-running: after a row's first disagreement its inputs differ, so every later token may too.
    Teacher-forced (`generate(force_tokens=ref_tokens)`): each step judged on the reference's inputs.
    """
    ref_tokens = ref_tokens.cpu()
    miss = forced_tokens.cpu() != ref_tokens
    worst = None if margins is None else (float(margins[miss].max()) if miss.any() else 0.0)
    return float((free_tokens.cpu() == ref_tokens).float().mean()), float((~miss).float().mean()), worst


def logit_agreement(ref, res, rows: int) -> tuple[float, float | None]:
    """(free-running token agreement, max |logit diff| over the steps where each row's greedy prefix still agrees
    with the reference: after that the inputs differ), over the first `rows` rows whose logits were kept."""
    agree = (ref.tokens == res.tokens).float().mean().item()
    if ref.logits is None or res.logits is None:
        return agree, None
    worst = 0.0
    n = ref.tokens.shape[0]
    ok = torch.ones(n, dtype=torch.bool)
    for t, (la, lb) in enumerate(zip(ref.logits, res.logits)):
        k = min(rows, la.shape[0], lb.shape[0])
        rows_ok = ok[:k]
        if rows_ok.any():
            worst = max(worst, (la[:k][rows_ok] - lb[:k][rows_ok]).abs().max().item())
        ok &= ref.tokens[:, t] == res.tokens[:, t]
    return agree, worst
