"""The fused decode forward (`capture.kernels=fused`): one decode step of an HF MoE model in ~12 kernels a layer.

Dims: T tokens (= rows, one token each), D hidden, Hq/Hkv heads, Dh head dim, R rotary dims, L cache slots,
E experts, K top-k, Is shared-expert (or dense MLP) intermediate, V vocab.
A raw CUDA graph of HF's modules replays hundreds of tiny kernels per step (rotary halves, mask building,
casts, router softmax/topk, sort/offsets for the grouped GEMM, counter updates); Inductor wins by fusing them
but needs 15-50 s to compile per batch size. This module instead runs the same math in a fixed sequence of
large kernels, each with a pure-PyTorch reference (`moecg.kernels.ref`) and a Triton version:

  per layer: qkv GEMM (one, with bias) | q/k norm + rotary + KV write | decode attention (split contexts merged
             in the kernel) | o GEMM | residual add + RMSNorm | router (+ shared expert gate/up + its gate) GEMM
             (one) | router kernel | [shared SiLU-mul | shared down GEMM, on a second stream] | routed experts
             (dispatcher) | shared gate + residual + next RMSNorm; a router that is its own linear (no shared
             expert) runs residual add + RMSNorm + router GEMV + top-k as one kernel (norm_route)
  dense layers: ... | gate/up GEMM (one) | SiLU-mul | down GEMM | residual + next RMSNorm
  Every projection GEMM runs ops.linear: the Triton GEMV where moecg.kernels.tiles' table has a rule for its
  (T, N, K), else cuBLAS (a block-FP8 weight: always the Triton GEMV). With fp8_dynamic inputs (model.activations)
  the kernel before a block-FP8 GEMM writes its output's act_quant too (`quant`: the norms, the attention per head of
  128, SiLU-mul) and the GEMM reads that (`xq`); the experts' down GEMM quantizes its own input.

Families (FUSED_ROUTER_KINDS x FUSED_FEATURES, checked by FamilyAdapter.check_supported): Mixtral, Qwen2/3-MoE,
GLM-4-MoE (sigmoid_group router: its fp32 GEMM runs apart from the shared expert's; partial rotary; q/k/v bias),
OLMoE (q/k norm over the whole projection, clip_qkv), GPT-OSS (router bias, topk_softmax, attention sinks,
sliding/full layers, biased transposed interleaved clamped-SwiGLU experts, RMSNorm that casts last), DeepSeek-V2/V3
(multi-head latent attention in its absorbed form, moecg.latent: the cache holds the latent and the rotary key;
softmax_group / sigmoid_group routers, dense first layers, shared experts).
It reads the HF model's own parameters and edits none of them (its `.data`, its forward, its state_dict stay
as they were). To make the qkv and router/shared-expert GEMMs one GEMM each it builds, once, its own concatenated
copies of those weights (as gpt-fast builds `wqkv` at load time); a lone weight that needs no padding (a router
without a shared expert beside it) is read in place. Memory: one more copy of the fused weights while the
FastDecode lives (`owned_bytes`), bf16: 1.72 GB for Qwen1.5-MoE-A2.7B (24 layers; q/k/v, shared gate/up +
shared gate + router: 6.0% of its 28.6 GB), 0.40 GB for Mixtral-8x7B at 8 layers (q/k/v; 1.7% of 23.7 GB), 1.01 GB for
Qwen3-30B-A3B (48 layers, q/k/v; 1.6% of 61.1 GB), counted on the meta device. Re-pointing the HF parameters at views
instead would save it but leave the model changed (its parameters' storage) after the FastDecode is gone. Weights
changed after construction are not seen: build a new FastDecode.
The prefill still runs the HF model (`DecodeEngine.forward` uses a decode forward only for one-token steps), on the
same cache.
The routed experts go through the attached moecg dispatcher (counters, masks, capacity all apply); with
`dispatch=fused` on CUDA they are two Triton kernels.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext as _nullctx
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from moecg import latent
from moecg.dispatch import state_of
from moecg.kernels import get_ops, ref
from moecg.fast.layers import FastPathError, FusedLayer, LayerBuilder, norm_eps
# what the fused step runs is declared beside the family facts (models/adapter.py), which never import this module
from moecg.models.adapter import FUSED_FEATURES, FUSED_ROUTER_KINDS, UnsupportedConfigError, adapter_for
from moecg.models.formats import fp8_input
from moecg.models.skew import router_logit_bias
from moecg.models.weights import stored

__all__ = ["FUSED_FEATURES", "FUSED_ROUTER_KINDS", "FastDecode", "FastPathError", "check_supported"]

# On CUDA with overlap_shared, layers whose fp32 router GEMV runs apart from the shared expert's gate/up GEMM
# (DeepSeek-V2/V3, Kimi-K2, GLM-4-MoE): True (the default) forks at the norm's output, the gate/up GEMM on the side
# stream with the rest of the shared expert, so the router GEMV, the router and the routed experts do not wait for
# it; False runs that GEMM on the main stream before the router, the shared expert forking after it. The same kernels
# and inputs: the same bits. Measured on one H100 (bench_step_variants.py's `side`, results/step_variants/side_*):
# DeepSeek-V2-Lite 27 layers 2.568 -> 2.496 ms at bs 1, 6.783 -> 6.694 at bs 8; GLM-4.5-Air 8 layers 2.067 -> 2.046,
# 5.507 -> 5.456; DeepSeek-V3 6 layers 3.153 -> 3.117, 7.460 -> 7.433.
SHARED_GEMM_ON_SIDE = True


def _q(out, quant: bool) -> tuple:
    """An op's outputs (a tuple, or one tensor) with its act_quant last: as given with quant, else None in its
    place."""
    out = out if isinstance(out, tuple) else (out,)
    return out if quant else (*out, None)


@contextmanager
def _launch_knobs(mode: int | None, preload: bool | None = None):
    """Launch the Triton kernels that run inside with PDL mode `mode` (None: leave the launch default as it is) and,
    unless None, weight preloads `preload` (moecg.kernels.launch.PRELOAD).

    The launch helpers read both from module attributes at launch time (graph capture records them); they are set for
    the duration only, so the attributes keep their defaults (None: auto; True) outside."""
    if mode is None and preload is None:
        yield
        return
    from moecg.kernels import launch  # triton: optional; the module whose PDL and PRELOAD the launches read

    prev = launch.PDL, launch.PRELOAD
    launch.PDL = launch.PDL if mode is None else mode
    launch.PRELOAD = launch.PRELOAD if preload is None else preload
    try:
        yield
    finally:
        launch.PDL, launch.PRELOAD = prev


def check_supported(model) -> None:
    """Raise FastPathError (before any CUDA work) if the fused decode forward cannot run this model.

    The checks live in one place, FamilyAdapter.check_supported (config fields and modules, kernels=fused)."""
    try:
        ad = adapter_for(model)
    except Exception as e:  # noqa: BLE001
        raise FastPathError(f"capture.kernels=fused: {e}") from e
    try:
        ad.check_supported(model.config, "fused", model=model)
    except UnsupportedConfigError as e:
        raise FastPathError(str(e)) from e


PDL_MODES = (None, 0, 1, 2)


class FastDecode:
    """Callable with the model forward's decode signature: (input_ids [B,1], cache, ...) -> .logits [B, 1, V].

    per_row_positions: on a cache whose layers carry per-row `lengths` (moecg.ragged.RaggedLayer) every row decodes
    at its own position (rotary, K/V slot, attention span and window); masks are the kernels' own, so a caller
    passes none.

    kernel_backend: "auto" (Triton on CUDA, else the PyTorch references), "triton" or "torch".
    pdl: the Triton kernels' programmatic dependent launch mode (Hopper+): None the launch default (auto: mode 2
      where the device and Triton support it, else 0), 0 off, 1 each kernel waits for its predecessor, 2 also
      triggers its successor's launch at its start. Results are the same in every mode; only launch overlap changes.
    preload: the Triton kernels load their constant weights (the GEMVs' first K step, the router's rows, the norms'
      weights, the MoE down kernel's first tile at batch 1) before their PDL wait, beside the kernel before them
      (moecg.kernels.launch.PRELOAD); False: after it. Results are the same bits either way.
    overlap_shared: on CUDA the shared expert (silu-mul + down GEMM) runs on a second stream beside the routed
      experts, joined before the combine: at small batches neither fills the GPU alone (same kernels, same numbers).
    fuse_router: a router that is its own linear, with or without a bias (softmax_topk or topk_softmax,
      power-of-two k, no shared expert beside it), runs with the residual add and norm before it as one kernel
      (ops.norm_route); False: add_rmsnorm, GEMM, router kernel.
    """

    per_row_positions = True

    def __init__(self, model, kernel_backend: str = "auto", *, pdl: int | None = None, overlap_shared: bool = True,
                 fuse_router: bool = True, preload: bool = True):
        if not (pdl is None or (type(pdl) is int and pdl in PDL_MODES)):
            raise ValueError(f"capture.pdl={pdl!r}: must be null (auto), 0 (off), 1 (wait only) or 2 (wait and "
                             "trigger the next launch)")
        for name, v in (("overlap_shared", overlap_shared), ("fuse_router", fuse_router), ("preload", preload)):
            if not isinstance(v, bool):
                raise ValueError(f"capture.{name}={v!r}: must be true or false")
        self.pdl, self.overlap_shared, self.fuse_router, self.preload = pdl, overlap_shared, fuse_router, preload
        check_supported(model)

        self.model = model
        self.on_layer = None
        self.adapter = ad = adapter_for(model)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.ops = get_ops(kernel_backend, self.device)
        self._side = None  # the shared expert's stream (overlap_shared), made once the model shows a shared expert
        self.backend = "triton" if self.ops is not ref else "torch"
        cfg = model.config
        self.cast_last = "rmsnorm_cast_last" in ad.features(cfg)  # GPT-OSS's norms multiply in fp32, then cast
        self.rotary_dim = ad.rotary_dim(cfg)
        # HF's eager attention rounds the scores (and, with sinks, the max-subtracted logits) to the model dtype; sdpa
        # and flash keep them in fp32. GPT-OSS runs eager here (its sinks have no sdpa path): the fused step rounds alike.
        self.eager_attn = getattr(cfg, "_attn_implementation", None) == "eager"
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm_w, self.norm_eps = inner.norm.weight, norm_eps(inner.norm)
        self.lm_head = model.lm_head.weight
        self.rotary = inner.rotary_emb
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        builder = LayerBuilder(model, ad, fuse_router)
        self.mla_layout = builder.mla_layout
        self.layers: list[FusedLayer] = [builder.build(i, layer) for i, layer in enumerate(ad.layers(model))]
        self.owned_bytes = builder.owned_bytes  # the fused weight copies this step holds (module docstring)
        # GEMMs taking fp8_dynamic inputs right after a norm read the norm kernel's own act_quant of its rows (its
        # `quant` output, the same values) instead of quantizing them again: per layer, whether the input norm's
        # (qkv) and the post-attention norm's consumers (the experts, the shared expert / dense MLP / router GEMM) do;
        # the last entry of _in_q is the final norm's (lm_head: full inputs)
        q = self.backend == "triton"
        self._in_q = [q and L.mla is None and fp8_input(L.wqkv) for L in self.layers] + [False]
        self._post_q = [q and (fp8_input(L.wcat) or fp8_input(L.wsh) or (
            L.experts is not None and fp8_input(stored(L.experts, "gate_up_proj")))) for L in self.layers]
        # the o projection's input, from the attention kernel (per head: a head dim of 128 columns or a multiple);
        # the shared expert's / dense MLP's down projection's, from silu_mul
        self._o_q = [q and L.mla is None and L.head_dim % 128 == 0 and fp8_input(L.wo) for L in self.layers]
        self._down_q = [q and fp8_input(L.w_sdown) for L in self.layers]

    def pdl_mode(self) -> int | None:
        """The PDL mode this step's Triton kernels launch with (None: it runs no Triton kernels)."""
        if self.backend != "triton":
            return None
        with _launch_knobs(self.pdl):
            from moecg.kernels import triton_ops  # triton: optional (this backend has it)

            return triton_ops.pdl_mode(self.device)

    def describe(self) -> dict:
        """The knobs that change what this step runs, for the results record."""
        return {"pdl": self.pdl, "pdl_mode": self.pdl_mode(), "preload": self.preload,
                "overlap_shared": self.overlap_shared,
                "fuse_router": self.fuse_router, "fused_weight_mib": self.owned_bytes / 2**20}

    def _side_stream(self):
        if not self.overlap_shared or self.device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _rope_tables(self, clayers):
        """cos/sin [L, R] for every slot of the cache; the cache must be linear (slot = position) in all layers."""
        length = clayers[0].keys.shape[2]
        odd = [i for i, c in enumerate(clayers) if getattr(c, "is_sliding", False) or c.keys.shape[2] != length]
        if odd:  # host-side check only (no sync); a captured step runs it at capture time
            raise FastPathError(f"FastDecode needs a linear KV cache (slot = position, {length} slots in every "
                                f"layer), e.g. moecg.engine.RowCache; layers {odd} are sliding/ring buffers")
        if length not in self._tables and self.mla_layout is not None:
            self._tables[length] = latent.rope_tables(self.rotary, length, self.dtype, self.device)  # [L, R/2] each
        if length not in self._tables:
            x = torch.zeros(1, 1, dtype=self.dtype, device=self.device)
            pos = torch.arange(length, device=self.device)[None]
            with torch.no_grad():
                cos, sin = self.rotary(x, pos)  # [1, L, R or R/2] model dtype, exactly HF's values
            cos, sin = cos[0], sin[0]
            if cos.shape[-1] * 2 == self.rotary_dim:
                # GPT-OSS's rotary gives one half (x1 c - x2 s | x2 c + x1 s): rotate_half with the table doubled,
                # the same products and sums, so the same bits
                cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            elif cos.shape[-1] != self.rotary_dim:
                raise FastPathError(f"{type(self.rotary).__name__} gives {cos.shape[-1]}-wide tables, expected the "
                                    f"rotary dims ({self.rotary_dim}) or half of them; use capture.kernels=hf")
            self._tables[length] = (cos.contiguous(), sin.contiguous())
        return self._tables[length]

    def _route(self, L: FusedLayer, logits):
        """Router logits [T, E] -> (idx [T, K], weights [T, K]) by the layer's router kind."""
        ops, s = self.ops, L.route
        if s.kind == "sigmoid_group":
            return ops.route_sigmoid_group(logits, L.choice_bias, s.top_k, s.n_group, s.topk_group, s.normalize,
                                           s.scaling)
        if s.kind == "topk_softmax":
            return ops.route_topk_softmax(logits, s.top_k)
        if s.kind == "softmax_group":
            return ops.route_softmax_group(logits, s.top_k, s.n_group, s.topk_group, s.scaling)
        route = ops.route if (s.top_k & (s.top_k - 1)) == 0 else ref.route  # the Triton kernel: power-of-two k
        return route(logits, s.top_k, s.normalize, L.route_dtype)

    def _mlp_down(self, L: FusedLayer, a, quant: bool):
        """The shared expert's (or dense MLP's) down projection of silu_mul's output a (with quant: (a, its
        act_quant))."""
        a, aq = _q(a, quant)
        return self.ops.linear(a, L.w_sdown, xq=aq)

    def _experts(self, L: FusedLayer, h, idx, w, valid, state, slot: int, hq=None):
        counters = state.layer(slot) if state is not None else None
        disp = state.dispatcher if state is not None else None
        if disp is None:
            ex, sp = L.experts, L.expert_spec
            return ref.moe_experts(h, idx, w, stored(ex, "gate_up_proj"), stored(ex, "down_proj"), valid, counters,
                                   spec=sp,
                                   gate_up_bias=ex.gate_up_proj_bias if sp.has_bias else None,
                                   down_bias=ex.down_proj_bias if sp.has_bias else None)
        if disp.fused_unreduced:
            return disp.unreduced(L.experts, h, idx, w, valid, counters, xq=hq)  # [T, K, D] fp32
        return disp.forward(L.experts, h, idx, w, valid, counters)[:, None]  # [T, 1, D]

    # -- the step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, input_ids, cache, use_cache: bool = True, logits_to_keep: int = 1, **_):
        with _launch_knobs(self.pdl, self.preload if self.backend == "triton" else None):
            return self._step(input_ids, cache)

    def _step(self, input_ids, cache):
        ops = self.ops
        T = input_ids.shape[0]
        if input_ids.shape[1] != 1:
            raise ValueError("FastDecode runs decode steps (one token per row); the prefill runs the HF model")
        clayers = cache.layers
        # per-row lengths [B] (moecg.ragged.RaggedLayer: each row at its own position, advanced by its engine), else
        # HF's one device counter per layer (every layer and row at the same position, advanced here)
        rows_pos = getattr(clayers[0], "lengths", None)
        pos = rows_pos[:T] if rows_pos is not None else clayers[0].cumulative_length
        cos, sin = self._rope_tables(clayers)
        state = state_of(self.model)
        valid = state.token_valid(T) if state is not None else None
        cl = self.cast_last
        x = F.embedding(input_ids[:, 0], self.embed)  # [T, D]
        res, h, hq = _q(ops.add_rmsnorm(x[:, None], None, self.layers[0].in_w, self.layers[0].in_eps, cast_last=cl,
                                        out_dtype=self.dtype, quant=self._in_q[0]), self._in_q[0])
        slot = 0
        n = len(self.layers)
        for i, L in enumerate(self.layers):
            if self.on_layer is not None:  # set by Capture while capturing, so a failure names its layer
                self.on_layer(i)
            oq = None  # the o projection's input quantized by the attention kernel (_o_q)
            if L.mla is not None:  # keys/values: the latent [.., C] and the rotary key [.., R]
                o = latent.attend(ops, L.mla, h, pos, cos, sin, clayers[i].keys, clayers[i].values)  # [T, H*Dv]
            else:
                qkv = ops.linear(h, L.wqkv, L.bqkv, xq=hq)  # [T, (Hq+2Hkv)*Dh]
                q = ops.rope_cache(qkv, pos, cos, sin, clayers[i].keys, clayers[i].values, L.n_q, L.n_kv,
                                   L.head_dim, L.q_norm, L.k_norm, L.qk_eps, clip=L.clip)  # [T, Hq, Dh]
                o, oq = _q(ops.attn_decode(q, clayers[i].keys, clayers[i].values, pos, L.scaling, L.window,
                                           sinks=L.sinks, eager=self.eager_attn, quant=self._o_q[i]),
                           self._o_q[i])  # [T, Hq*Dh]
            a = ops.linear_partials(o, L.wo, L.bo, xq=oq)  # [T, S, D]: S split-K partial rows, or the output
            pq, nq = self._post_q[i], self._in_q[i + 1]  # quant: the next GEMMs take fp8_dynamic inputs
            if L.norm_route:  # residual + norm + router GEMV + softmax/top-k: one kernel
                rb = L.bcat[: L.n_experts] if L.bcat is not None else None  # the router's own bias (GPT-OSS)
                res, h, idx, w, hq = _q(ops.norm_route(a, res, L.post_w, L.post_eps, L.wcat[: L.n_experts], L.top_k,
                                                       L.norm_topk, L.route_dtype, router_logit_bias(L.router),
                                                       cast_last=cl, quant=pq, router_b=rb, kind=L.route.kind), pq)
            else:
                res, h, hq = _q(ops.add_rmsnorm(a, res, L.post_w, L.post_eps, cast_last=cl, quant=pq), pq)
            nw, neps = (self.layers[i + 1].in_w, self.layers[i + 1].in_eps) if i + 1 < n else (self.norm_w,
                                                                                               self.norm_eps)
            if L.experts is None:
                if L.mlp is not None:
                    y = self.adapter.moe_output(L.mlp(h))  # [T, D]
                else:
                    y = self._mlp_down(L, ops.silu_mul(ops.linear(h, L.wcat, xq=hq), L.shared_inter,
                                                       quant=self._down_q[i]), self._down_q[i])  # [T, D]
                res, h, hq = _q(ops.add_rmsnorm(y[:, None], res, nw, neps, cast_last=cl, quant=nq), nq)
                continue
            side = None  # the shared expert's stream, once forked
            if not L.norm_route:  # (norm_route layers have their idx, w already, and no shared expert)
                side = self._side_stream() if L.shared_inter else None
                # SHARED_GEMM_ON_SIDE: an fp32 router apart from wcat, which then feeds only the shared expert
                early = (SHARED_GEMM_ON_SIDE and side is not None and L.router_w32 is not None
                         and L.shared_gate_col is None and L.wsh is None)
                main = torch.cuda.current_stream(self.device) if side is not None else None
                if early:  # fork at h: the shared gate/up GEMM on the side stream too, the router GEMV first here
                    side.wait_stream(main)
                with torch.cuda.stream(side) if early else _nullctx():
                    z = ops.linear(h, L.wcat, L.bcat, xq=hq) if L.wcat is not None else None  # [T, 2Is (+1) (+ E)]
                if side is not None and not early:  # fork: the shared expert starts once z exists, the routing
                    side.wait_stream(main)  # goes on here
                if L.router_w32 is not None:
                    logits = ops.router_logits(h, L.router_w32)  # [T, E] fp32, as HF's router
                else:
                    logits = z[:, L.r0: L.r0 + L.n_experts]  # [T, E]
                bias = router_logit_bias(L.router)  # router skew acts here as in HF's (skewed) router forward
                if bias is not None:
                    logits = logits + bias.to(logits.dtype)  # [T, E]
                idx, w = self._route(L, logits)  # [T, K], [T, K]
            shared = gate = None
            if L.shared_inter:
                with torch.cuda.stream(side) if side is not None else _nullctx():
                    zs = ops.linear(h, L.wsh, xq=hq) if L.wsh is not None else z  # [T, 2Is ...]
                    shared = self._mlp_down(L, ops.silu_mul(zs, L.shared_inter, quant=self._down_q[i]),
                                            self._down_q[i])  # [T, D]
                gate = z[:, L.shared_gate_col] if L.shared_gate_col is not None else None  # [T]
            y = self._experts(L, h, idx, w, valid, state, slot, hq)  # [T, K or 1, D]
            if side is not None:  # join before the combine reads `shared`
                main.wait_stream(side)
            slot += 1
            res, h, hq = _q(ops.add_rmsnorm(y, res, nw, neps, shared, gate, cast_last=cl, quant=nq), nq)
        logits = F.linear(h, self.lm_head)  # [T, V]
        if rows_pos is None:
            torch._foreach_add_([c.cumulative_length for c in clayers], 1)
        return SimpleNamespace(logits=logits[:, None, :])
