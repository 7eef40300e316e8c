"""Decode prompts: seeded random ids, byte windows of the shipped held-out text, or a file of token ids.

Dims: B rows, S prompt tokens, V vocab. Host-side only, so the run plan loads (and checks) them before any
CUDA work.
"""
from __future__ import annotations

from pathlib import Path

import torch

from moecg.quality import heldout_prompts


class PromptError(ValueError):
    pass


def _read_file(path: str, B: int, S: int, vocab: int) -> torch.Tensor:
    p = Path(str(path)).expanduser()
    if not p.is_file():
        raise PromptError(f"prompt_file={path}: no such file (one line of space-separated token ids per row)")
    rows = []
    for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append([int(t) for t in line.split()])
        except ValueError:
            word = next(t for t in line.split() if not t.lstrip("-").isdigit())
            raise PromptError(f"prompt_file={path}, line {n}: {word[:20]!r} is not a token id; prompts=file reads "
                              "space-separated integer token ids (tokenize the text first)") from None
    if len(rows) < B or any(len(r) < S for r in rows[:B]):
        short = [i + 1 for i, r in enumerate(rows[:B]) if len(r) < S]
        raise PromptError(f"prompt_file={path}: need batch_size={B} rows of at least prompt_len={S} token ids, found "
                          f"{len(rows)} rows" + (f" (rows {short[:5]} are shorter)" if short else "")
                          + ": lower batch_size/prompt_len or add rows")
    ids = torch.tensor([r[:S] for r in rows[:B]])  # [B, S]
    if ids.max() >= vocab or ids.min() < 0:
        raise PromptError(f"prompt_file={path}: token ids must lie in [0, {vocab}) for this model "
                          f"(found {int(ids.min())}..{int(ids.max())})")
    return ids


def make_prompts(kind: str, batch_size: int, prompt_len: int, seed: int, vocab: int,
                 prompt_file: str | None = None) -> torch.Tensor:
    """[B, S] int64 prompt ids on the host."""
    B, S = batch_size, prompt_len
    if kind == "random":
        g = torch.Generator().manual_seed(int(seed))
        return torch.randint(0, vocab, (B, S), generator=g)  # [B, S]
    if kind == "file":
        if not prompt_file:
            raise PromptError("prompts=file needs prompt_file=/path (one line of space-separated token ids per row)")
        return _read_file(prompt_file, B, S, vocab)
    if kind == "heldout":
        if vocab != 256:
            raise PromptError(f"prompts=heldout gives byte ids, and this model's vocab is {vocab}: use a byte-level "
                              "model (*_stdlib) or prompts=random")
        try:
            return heldout_prompts(B, S, int(seed))
        except ValueError as e:
            raise PromptError(f"prompts=heldout: {e}") from None
    raise PromptError(f"prompts={kind!r}: choose random, heldout or file")
