"""Per-layer graphs: a whole decoder layer (scope `layer`) or its attention half (scope `attn`), from outside.

The wrapper replaces the decoder layer's `forward` on the instance only (the model stays an HF model;
`uninstall` deletes the attribute). Scope `attn` graphs input norm + attention + residual + post-attention
norm and runs the MoE FFN eagerly between graphs (the family adapter names the four modules). A decode forward (one token per row) whose tensor shapes match a captured graph is
replayed; anything else (prefill, an uncaptured batch) runs the original forward.
Static inputs are shared between layers where the source tensor is the same object (cos/sin/mask are built
once per step) and a layer's static output feeds the next layer's graph directly, so chained whole-layer
graphs copy nothing between them.
"""
from __future__ import annotations

from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from moecg.capture.graph import GraphRunner

_SCALARS = (int, float, bool, str, type(None))


def _same(a, b) -> bool:
    return a is b or (isinstance(a, _SCALARS) and isinstance(b, _SCALARS) and a == b)


class LayerGraphs:
    def __init__(self, targets: list[tuple[int, str, object]], runner: GraphRunner, adapter, compile_fn=None):
        self.targets = targets  # (layer index, scope, decoder layer)
        self.adapter = adapter
        self.compile_fn = compile_fn  # wraps the captured piece (e.g. torch.compile), None: as is
        self.runner = runner
        self.capturing = False
        self._owner: dict[int, Tensor] = {}  # id(static) -> static, every static tensor we own
        self._by_src: dict[int, Tensor] = {}  # during one capture pass: id(source) -> static holding it
        self._last_src: dict[int, Tensor] = {}  # id(static) -> the source last copied into it
        self.fallbacks = 0

    def install(self) -> None:
        for idx, scope, module in self.targets:
            module.forward = self._wrap(idx, scope, module, type(module).forward.__get__(module))

    def uninstall(self) -> None:
        for _, _, module in self.targets:
            module.__dict__.pop("forward", None)

    def begin_pass(self) -> None:
        self.capturing = True
        self._by_src.clear()

    def end_pass(self) -> None:
        self.capturing = False
        self._by_src.clear()

    def _static_for(self, src: Tensor) -> Tensor:
        if id(src) in self._owner:  # a previous graph's static output: read it in place
            return src
        if id(src) in self._by_src:
            return self._by_src[id(src)]
        static = src.clone()
        self._owner[id(static)] = static
        self._by_src[id(src)] = static
        self._last_src[id(static)] = src
        return static

    def _wrap(self, idx: int, scope: str, module, orig):
        piece = self.compile_fn or (lambda f: f)
        if scope == "layer":
            orig = piece(orig)
            return lambda *args, **kwargs: self._call(idx, orig, args, kwargs)
        # scope "attn": input norm + attention + residual + post-attention norm in one graph, MoE FFN eager.
        # Capturing the norms and the residual too saves ~13 eager kernels per layer over attention alone.
        a = self.adapter
        attn, norm1, norm2, mlp = (getattr(module, n) for n in (a.attn, a.input_norm, a.post_norm, a.moe))

        def attn_part(hidden_states, *args, **kwargs):
            h = hidden_states + attn(norm1(hidden_states), *args, **kwargs)[0]  # [B, S, D]
            return h, norm2(h)

        graphed = piece(attn_part)

        def forward(hidden_states, *args, **kwargs):
            h, normed = self._call(idx, graphed, (hidden_states, *args), kwargs)
            return h + a.moe_output(mlp(normed))  # GPT-OSS's block also returns its router scores

        return forward

    def _call(self, idx: int, orig, args, kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        pos = [j for j, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        if not pos:
            return orig(*args, **kwargs)
        first = leaves[pos[0]]
        key = (idx, tuple((tuple(leaves[j].shape), leaves[j].dtype) for j in pos))
        if key in self.runner:
            meta = self.runner.entries[key].meta
            if all(_same(leaves[j], c) for j, c in meta["consts"].items()):
                for j, static in zip(pos, meta["statics"]):
                    src = leaves[j]
                    if src is not static and self._last_src.get(id(static)) is not src:
                        static.copy_(src)
                        self._last_src[id(static)] = src
                return self.runner.replay(key)
            self.fallbacks += 1
            return orig(*args, **kwargs)
        decode = first.dim() == 3 and first.shape[1] == 1
        if not (self.capturing and decode):
            return orig(*args, **kwargs)
        statics = [self._static_for(leaves[j]) for j in pos]

        def fn(*tensors):
            filled = list(leaves)
            for j, t in zip(pos, tensors):
                filled[j] = t
            a, kw = tree_unflatten(filled, spec)
            return orig(*a, **kw)

        try:
            entry = self.runner.capture(key, fn, statics)
        except Exception as e:
            e.layer = idx  # Capture's error names the layer whose graph failed
            raise
        entry.meta.update(statics=statics, rows=first.shape[0], layer=idx,
                          consts={j: leaves[j] for j in range(len(leaves)) if j not in pos})
        for out in tree_flatten(entry.outputs)[0]:
            if isinstance(out, Tensor):
                self._owner[id(out)] = out
        # the capture did not execute: replay once so the rest of this (scratch) pass sees real values
        out = self.runner.replay(key)
        entry.replays -= 1  # not a measured replay
        return out
