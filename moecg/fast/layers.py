"""The fused decode step's per-layer weights (FusedLayer), built once from an HF model's modules (LayerBuilder).

Dims: D hidden, Hq/Hkv heads, Dh head dim, E experts, Is shared-expert (or dense MLP) intermediate.
It reads the HF model's own parameters and edits none of them. To make the qkv and router/shared-expert GEMMs one GEMM
each it builds its own concatenated copies of those weights (fuse, as gpt-fast builds `wqkv` at load time); a lone
weight that needs no padding is read in place. `LayerBuilder.owned_bytes` counts the copies (moecg.fast.step's
docstring gives their sizes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moecg import latent
from moecg.kernels.ref import NORM_ROUTE_KINDS
from moecg.models.adapter import FUSED_ROUTER_KINDS, UnsupportedConfigError
from moecg.models.formats import BLOCK, BlockFp8, fuse_rows
from moecg.models.skew import router_logit_bias
from moecg.models.weights import stored


class FastPathError(UnsupportedConfigError):
    pass


@dataclass
class FusedLayer:
    in_w: torch.Tensor
    in_eps: float
    post_w: torch.Tensor
    post_eps: float
    wqkv: torch.Tensor | None  # [(Hq+2Hkv)*Dh, D] a copy of the HF q/k/v weights, concatenated (None: MLA)
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    n_q: int
    n_kv: int
    head_dim: int
    scaling: float
    window: int  # 0: full causal attention, else keys at positions (pos - window, pos] (adapter.attention_windows)
    q_norm: torch.Tensor | None  # [Dh] per head or [Hq*Dh] over the whole projection (OLMoE)
    k_norm: torch.Tensor | None
    qk_eps: float
    sinks: torch.Tensor | None = None  # [Hq] attention sink logits (GPT-OSS)
    clip: float | None = None  # OLMoE's clip_qkv
    experts: object | None = None  # HF experts module (routed experts), None: dense layer
    mlp: object | None = None  # dense MLP module for non-MoE layers whose gate/up/down could not be fused
    wcat: torch.Tensor | None = None  # [2Is (+1) (+ E), D]: shared/dense gate | up | shared gate logit | router
    # (a copy, padded to 8 rows; a lone router weight is the HF parameter itself, read only)
    bcat: torch.Tensor | None = None  # its bias (zeros but the router's rows), when the router's linear has a bias
    r0: int = 0  # router rows in wcat: [r0, r0 + n_experts)
    n_experts: int = 0
    router: object | None = None  # HF router module: its skew bias (moecg.models.skew) is read at each call
    router_w32: torch.Tensor | None = None  # [E, D] router weight for an fp32 logits GEMM, apart from wcat
    choice_bias: torch.Tensor | None = None  # [E] sigmoid_group's e_score_correction_bias
    top_k: int = 0
    norm_topk: bool = False
    route: object | None = None  # the adapter's RouterSpec of this layer's router
    route_dtype: torch.dtype | None = None
    expert_spec: object | None = None  # the adapter's ExpertSpec (layout, activation, biases)
    shared_inter: int = 0
    shared_gate_col: int | None = None
    w_sdown: torch.Tensor | None = None  # [D, Is] shared expert's (or the dense MLP's) down projection
    wsh: object | None = None  # [2Is, D] block-FP8 shared gate | up (a BlockFp8): apart from wcat, which then holds
    #                            the shared gate logit and the router only
    norm_route: bool = False  # the router is wcat alone (+ bcat, its bias; no shared expert): ops.norm_route
    mla: latent.LatentAttention | None = None  # multi-head latent attention's weights (wqkv, q/k norms unused)


def fuse(params: list, align: int = 1) -> tuple:
    """(params concatenated along dim 0 as a new tensor, its bytes); the parameters are only read.

    A lone parameter that needs no padding is returned itself (0 bytes: nothing copied).
    align: pad the rows to a multiple (zero rows at the end), so a GEMM's output rows stay 16-byte aligned;
    an odd row count (e.g. 2*5632 + 1 + 60) sends cuBLAS to a slow unaligned kernel.
    Block-FP8 weights (moecg.models.formats.BlockFp8, all of them or none) fuse into one, values and scales.
    """
    rows = sum(p.shape[0] for p in params)
    pad = -rows % align
    if len(params) == 1 and not pad:
        return (params[0] if isinstance(params[0], BlockFp8) else params[0].detach()), 0
    if any(isinstance(p, BlockFp8) for p in params):
        if not all(isinstance(p, BlockFp8) for p in params):
            raise FastPathError("a fused GEMM mixes block-FP8 and unquantized weights; use capture.kernels=hf")
        parts = [(p.q.detach(), p.scale.detach(), p.rows) for p in params]
        if pad:
            K = parts[0][0].shape[1]
            parts.append((parts[0][0].new_zeros(pad, K), parts[0][1].new_ones(1, parts[0][1].shape[1]), BLOCK))
        if len({p.act for p in params}) > 1:
            raise FastPathError("a fused GEMM mixes activation quantization (model.activations) across its weights")
        q, scale, g = fuse_rows(parts)
        fused = BlockFp8(q, scale, g, params[0].dtype, params[0].act)
        return fused, fused.stored_bytes()
    parts = [p.detach() for p in params]
    if pad:
        parts.append(parts[0].new_zeros(pad, *parts[0].shape[1:]))
    cat = torch.cat(parts, dim=0)  # [rows + pad, ...]
    return cat, cat.numel() * cat.element_size()



def norm_eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class LayerBuilder:
    """FusedLayer per decoder layer of `model` (build), for the fused step: standard or latent attention, then a dense
    MLP or an MoE block. owned_bytes: the bytes of the copies made so far."""

    def __init__(self, model, ad, fuse_router: bool):
        cfg = model.config
        self.ad, self.fuse_router = ad, fuse_router
        self.dtype = next(model.parameters()).dtype
        self.features = ad.features(cfg)
        self.windows = ad.attention_windows(cfg)  # per layer, 0 = full: as the family's HF modeling code masks
        self.clip = getattr(cfg, "clip_qkv", None)  # OLMoE: q, k, v clamped after the q/k norm
        self.mla_layout = ad.mla_rope_layout(cfg) if ad.attention == "mla" else None
        self.owned_bytes = 0

    def build(self, i: int, layer) -> FusedLayer:
        ad = self.ad
        at = getattr(layer, ad.attn)
        L = self._latent(layer, ad, at) if self.mla_layout is not None else self._standard(i, layer, ad, at)
        block = ad.moe_block(layer)
        if block is None:
            self._dense(L, ad, getattr(layer, ad.moe))
        else:
            self._moe(L, ad, block, layer)
        return L

    def _latent(self, layer, ad, at) -> FusedLayer:
        A = latent.build(at, self.mla_layout, self._fuse)
        if A.ba is not None:
            self.owned_bytes += A.ba.numel() * A.ba.element_size()
        if isinstance(stored(at.kv_b_proj), BlockFp8):  # dequantized once for the per-head GEMVs (latent.build)
            self.owned_bytes += A.w_uk.untyped_storage().nbytes()  # w_uk and w_uv: views of one copy
        o_proj = ad.o_of(at)
        return FusedLayer(
            in_w=getattr(layer, ad.input_norm).weight, in_eps=norm_eps(getattr(layer, ad.input_norm)),
            post_w=getattr(layer, ad.post_norm).weight, post_eps=norm_eps(getattr(layer, ad.post_norm)),
            wqkv=None, bqkv=A.ba, wo=stored(o_proj), bo=o_proj.bias, n_q=A.n_heads, n_kv=1,
            head_dim=A.nope + A.rope, scaling=A.scaling, window=0, q_norm=None, k_norm=None, qk_eps=1e-6, mla=A)

    def _standard(self, i, layer, ad, at) -> FusedLayer:
        qkv, bias = ad.qkv_of(at)
        n_q = qkv[0].shape[0] // at.head_dim
        n_kv = qkv[1].shape[0] // at.head_dim
        o_proj = ad.o_of(at)
        q_norm = at.q_norm.weight if getattr(at, "q_norm", None) is not None else None
        k_norm = at.k_norm.weight if getattr(at, "k_norm", None) is not None else None
        if q_norm is not None and (q_norm.numel(), k_norm.numel()) not in ((at.head_dim, at.head_dim),
                                                                           (n_q * at.head_dim, n_kv * at.head_dim)):
            raise FastPathError(f"layer {i}: q/k norms of {q_norm.numel()} / {k_norm.numel()} elements are neither "
                                f"per head ({at.head_dim}) nor over the whole projection; use capture.kernels=hf")
        return FusedLayer(
            in_w=getattr(layer, ad.input_norm).weight, in_eps=norm_eps(getattr(layer, ad.input_norm)),
            post_w=getattr(layer, ad.post_norm).weight, post_eps=norm_eps(getattr(layer, ad.post_norm)),
            wqkv=self._fuse(qkv),
            bqkv=self._fuse(bias) if all(b is not None for b in bias) else None,
            wo=stored(o_proj), bo=o_proj.bias, n_q=n_q, n_kv=n_kv, head_dim=at.head_dim,
            scaling=float(at.scaling), window=self.windows[i], q_norm=q_norm, k_norm=k_norm,
            qk_eps=norm_eps(at.q_norm) if q_norm is not None else 1e-6,
            sinks=at.sinks if "attention_sinks" in self.features else None,
            clip=float(self.clip) if self.clip is not None else None,
        )

    def _dense(self, L: FusedLayer, ad, mlp) -> None:
        """A dense MLP: gate/up as one GEMM when its projections are plain bias-free linears, else its own forward."""
        try:
            mods = [getattr(mlp, n) for n in ad.mlp_projs]
        except AttributeError:
            mods = None
        if mods is None or any(getattr(m, "bias", None) is not None or not hasattr(m, "weight") for m in mods):
            L.mlp = mlp
            return
        gate, up, L.w_sdown = (stored(m) for m in mods)
        L.shared_inter = gate.shape[0]
        L.wcat = self._fuse([gate, up], align=8)

    def _moe(self, L: FusedLayer, ad, block, layer) -> None:
        router = getattr(block, ad.router)
        router_logit_bias(router)  # refuses a router forward it cannot reproduce, before any CUDA work
        L.router = router
        L.experts = getattr(block, ad.experts)
        L.expert_spec = ad.expert_spec(L.experts)
        spec = ad.router_spec(router)
        if spec.kind not in FUSED_ROUTER_KINDS:
            raise FastPathError(f"capture.kernels=fused has no router kernel for router kind {spec.kind!r} "
                                f"(has: {', '.join(FUSED_ROUTER_KINDS)}); use capture.kernels=hf")
        L.route = spec
        L.top_k, L.norm_topk = spec.top_k, spec.normalize
        L.route_dtype = torch.float32 if spec.weights_fp32 else self.dtype
        logit_bias, L.choice_bias = ad.router_biases(router)
        rows = []
        shared = ad.shared_expert_of(layer)
        if shared is not None:
            s_gate, s_up, L.w_sdown = ad.mlp_weights(shared)
            L.shared_inter = s_gate.shape[0]
            if isinstance(s_gate, BlockFp8):  # block-FP8: its own GEMM (the router's rows stay in the model dtype)
                L.wsh = self._fuse([s_gate, s_up])
            else:
                rows += [s_gate, s_up]
            sg = ad.shared_gate_of(layer)
            if sg is not None:
                L.shared_gate_col = sum(r.shape[0] for r in rows)
                rows.append(sg.weight)
        L.r0 = sum(r.shape[0] for r in rows)
        L.n_experts = router.weight.shape[0]
        if spec.logits_fp32:
            # HF's router casts both operands to fp32 (DeepSeek-V3 / GLM keep the weight in fp32): its own GEMM
            if logit_bias is not None:
                raise FastPathError(f"{type(router).__name__}: a bias on an fp32 router GEMM is not modelled; "
                                    "use capture.kernels=hf")
            L.router_w32 = router.weight
        else:
            rows.append(router.weight)
        if rows:
            L.wcat = self._fuse(rows, align=8)
            if logit_bias is not None and not spec.logits_fp32:
                L.bcat = L.wcat.new_zeros(L.wcat.shape[0])  # [rows]: zeros but the router's, whose bias is copied
                L.bcat[L.r0: L.r0 + L.n_experts] = logit_bias.detach()
                self.owned_bytes += L.bcat.numel() * L.bcat.element_size()
        L.norm_route = (self.fuse_router and L.r0 == 0 and L.wcat is not None and L.router_w32 is None
                        and spec.kind in NORM_ROUTE_KINDS and (L.top_k & (L.top_k - 1)) == 0)

    def _fuse(self, params, align: int = 1) -> torch.Tensor:
        cat, nbytes = fuse(params, align)
        self.owned_bytes += nbytes
        return cat
