"""Tile choices of the MoE expert kernels, as one table keyed by shape and passed to the kernels as arguments.

Dims: T tokens (rows of the step: the captured bucket), D hidden, I expert intermediate, E experts.
`moe_tiles(T, D, I, E, weights, activations, kernel)` walks the experts' format's rules (FORMAT_TILE_RULES), then
MOE_TILE_RULES, in order and returns the tiles of the first rule whose ranges hold the shape (each range half-open,
[lo, hi)), whose activations hold model.activations and whose kernels hold the asking kernel family (KERNELS);
DEFAULT where none does. Both kernel families read it in their
weights' format: the dropless kernels (`moe.moe_experts`) with T, the most rows an expert gets, and the capacity
kernels (`capacity.capacity_experts`, through `capacity_tiles`) with C, the most an expert's slots hold (C = 1 at most
decode sizes), which run the same GEMM tiles on other rows. A caller that sweeps tiles passes `tiles=MoeTiles(...)`
instead (experiments/bench_kernels.py).

The values come from experiments/bench_kernels.py on an H200 (experiments/results/kernels/): 64x128 tiles, 4 warps,
4 stages are best or within 3% for the Qwen shapes at bs 1-32; Mixtral-sized experts (I*D >= 32M, i.e. 4096 x 14336)
prefer 32x256 with 3 stages. A rule that depends on T costs one more compilation per distinct tile set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

_ANY = (0, math.inf)


def _within(*pairs) -> bool:
    """Every (value, (lo, hi)) pair has lo <= value < hi."""
    return all(lo <= v < hi for v, (lo, hi) in pairs)


def _first(rules, default, *shape):
    """The tiles of the first rule that holds the shape, else default."""
    return next((r.tiles for r in rules if r.holds(*shape)), default)


@dataclass(frozen=True)
class MoeTiles:
    block_m: int = 16  # assignments (rows) of one expert per program: >= 16 on tl.dot, fewer on the CUDA cores
    up_n: int = 64  # gate/up output columns per program (of I)
    up_k: int = 128  # D step of the up GEMM's loop
    down_n: int = 64  # output columns per program (of D)
    down_k: int = 128  # I step of the down GEMM's loop
    warps: int = 4
    stages: int = 4
    down_split: int = 1  # split-K of the down GEMM over I (batch-1 steps: more programs); deterministic, rounded once
    up_split: int = 1  # split-K of the up GEMM over D (bf16 / fp32 experts), as down_split
    pdl_trigger: bool = True  # under PDL mode 2, the MoE kernels trigger their successor's launch at their start
    paired: bool = True  # interleaved gate/up columns (GPT-OSS) as one 2 x up_n tile (False: two stride-2 loads)


KERNELS = ("dropless", "capacity")  # moe.moe_experts (T rows), capacity.capacity_experts (C slots an expert)


@dataclass(frozen=True)
class TileRule:
    tiles: MoeTiles
    tokens: tuple = _ANY  # T
    hidden: tuple = _ANY  # D
    inter: tuple = _ANY  # I
    experts: tuple = _ANY  # E
    weight: tuple = _ANY  # I*D, the elements of one expert's projection: what a decode GEMM streams
    activations: tuple = ("full", "fp8_dynamic")  # model.activations: how block-FP8 experts take their inputs
    kernels: tuple = KERNELS  # the kernel families the rule serves (measured on one alone: that one)

    def holds(self, T: int, D: int, I: int, E: int, activations: str = "full",  # noqa: E741
              kernel: str = "dropless") -> bool:
        return activations in self.activations and kernel in self.kernels and _within(
            (T, self.tokens), (D, self.hidden), (I, self.inter), (E, self.experts), (I * D, self.weight))


DEFAULT = MoeTiles()
MOE_TILE_RULES: tuple[TileRule, ...] = (
    # Mixtral-8x7B's experts (D 4096, I 14336): longer K steps and narrower columns stream the big weights faster
    # (PDL: their successors launch only as their blocks exit: an early trigger measured 4% slower at bs 1 on the
    # H200, bench_step_variants.py on the Mixtral shape, experiments/results/step_variants/)
    TileRule(MoeTiles(up_n=32, up_k=256, down_n=32, down_k=256, stages=3, pdl_trigger=False),
             weight=(32 * 2**20, math.inf)),
)


# At 32-64 rows on Qwen3-30B-A3B's experts (D 2048, I 768, E 128; the expert grid: every expert hit, about 4 rows each
# at 64) the down kernel's 64-column programs (48 KB of e4m3 each, 6 K steps) took 48% of the step (198 us a layer at bs
# 64 where its bytes need 66) and 128 columns halve them: in the captured step on one H100 (bench_step_variants.py,
# 24 layers, experiments/results/down_tiles/), block-FP8 with fp8_dynamic inputs bs 64 10.297 -> 8.782 ms, bs 32
# 6.133 -> 5.968 (bs 16 4.554 -> 4.571: not taken); weight-only (W8A16) bs 64 11.502 -> 10.321 and bs 32 7.039 ->
# 6.760, and on 256 columns 9.733 / 6.646 (QWEN3_DOWN_W8, which made the fp8_dynamic step slower, 10.093 at bs 64);
# bf16 (12 layers) bs 64 7.245 -> 6.543, bs 32 5.026 -> 5.008 (not taken). The same bits (each output column's sum
# unchanged). Other shapes, and more rows, not measured.
QWEN3_DOWN = MoeTiles(down_n=128)
QWEN3_DOWN_W8 = MoeTiles(down_n=256)


# bf16 / fp32 experts (model.weights=full), ahead of the rules above.
FULL_MOE_TILE_RULES: tuple[TileRule, ...] = (
    # GPT-OSS's experts (D 2880, I 2880; interleaved gate/up, read as one 2 x up_n tile): 32 columns and 3 stages,
    # twice the programs; the 12-layer GPT-OSS-20B step 1.972 -> 1.637 ms at bs 1, 5.454 -> 4.449 at bs 8, the same bits
    # (bench_step_variants.py on an H200, experiments/results/step_variants/tiles_gpt_oss_20b.md). 256-wide K steps
    # on the paired 128-column tile at 3 stages ran 12-19x slower (24 ms a step): keep paired tiles <= 64 x 256.
    # At 8 rows (about 20 of 32 experts hit, 45 column blocks of 64 each) 128-column down programs: the same step on one
    # H100 5.416 -> 5.332 / 5.330 ms in two runs; at bs 1 1.839 -> 1.930 and at bs 16 7.009 -> 7.021, not taken there;
    # 9-15 rows take it unmeasured. At bs 1, 32 columns (360 down programs where 180 made 1.4 waves on 132 SMs):
    # 1.841 -> 1.809 ms (-1.7%; predicted -6% from the waves alone: the down kernel went 35.1 -> 32.8 us a layer, 2.0
    # TB/s, so the waves were not what bounds it), without PDL 1.855 -> 1.842, and on an H200 earlier 1.699 -> 1.670
    # (experiments/results/gpt_oss_router/, step_variants/tiles_up32_gpt_oss_20b.md). The same bits. Not for the
    # capacity kernels at C 1 (their grid: every expert's slots): capacity+fused at bs 1 went 7.95 -> 8.35 ms with it
    # (and the router change of the same commit; the router alone not measured there). Since the transposed experts
    # load through k-major tiles (cp.async), 64 columns again at bs 1 (that rule dropped): 1.862 -> 1.755 ms and 1.862
    # -> 1.754 in two runs on one H100, where the package before them ran 32 columns at 1.799 and 64 at 1.834; the
    # same bits (results/step_variants/kmajor_gpt_oss_20b*). And the dropless kernels back on 64 up columns (the
    # paired 128 x 128 tile), the same call: bs 1 1.755 -> 1.729 ms, bs 8 5.054 -> 4.987 (5.055 -> 4.987 in an
    # earlier call), bs 16 6.596 -> 6.474, the same bits (step_variants/upn64_gpt_oss_20b.*, kmajor_gpt_oss_20b.*);
    # the capacity kernels keep 32 (not measured).
    TileRule(MoeTiles(stages=3, down_n=128), tokens=(8, 16), hidden=(2880, 2881), inter=(2880, 2881),
             kernels=("dropless",)),
    TileRule(MoeTiles(stages=3), hidden=(2880, 2881), inter=(2880, 2881), kernels=("dropless",)),
    TileRule(MoeTiles(up_n=32, stages=3, down_n=128), tokens=(8, 16), hidden=(2880, 2881), inter=(2880, 2881),
             kernels=("capacity",)),
    TileRule(MoeTiles(up_n=32, stages=3), hidden=(2880, 2881), inter=(2880, 2881), kernels=("capacity",)),
    # At batch 1, Qwen1.5-MoE's experts (D 2048, I 1408, 60) and GLM-4.5-Air's (D 4096, I 1408): 32 columns, twice
    # the programs; Qwen1.5 24 layers 1.832 -> 1.780 ms, GLM-4.5-Air 8 layers 1.651 -> 1.620 (two runs each). Not on
    # the others measured: DeepSeek-V2-Lite (Qwen1.5's expert shape, 64 experts, top 6) 2.204 -> 2.242, Qwen3-30B-A3B
    # and OLMoE unchanged (0.803 / 0.805, 0.988 / 0.989), DeepSeek-V3 3.083 -> 3.126
    # (experiments/results/step_variants/up32_*.md, table_*.md).
    TileRule(MoeTiles(up_n=32), tokens=(1, 2), hidden=(2048, 2049), inter=(1408, 1409), experts=(0, 64)),
    TileRule(MoeTiles(up_n=32), tokens=(1, 2), hidden=(4096, 4097), inter=(1408, 1409)),
    # At 64 rows, Qwen3-30B-A3B's experts (D 2048, I 768, E 128) and OLMoE's (D 2048, I 1024, E 64): 128 output
    # columns a down program (QWEN3_DOWN); OLMoE 16 layers bs 64 6.073 -> 5.572 ms on one H100, the same bits
    # (experiments/results/down_tiles/); Qwen1.5-MoE's experts (I 1408, E 60) unchanged (10.263 / 10.273): not taken.
    TileRule(QWEN3_DOWN, tokens=(64, 65), hidden=(2048, 2049), inter=(768, 1025)),
)


# Block-FP8 experts (moecg.models.formats), ahead of the rules above: at batch 1 the dropless kernels stream their
# few experts faster with 256-wide K steps and 3 stages (Qwen3-30B-A3B's layer, H200, bench_weights_kernels.py:
# 24.7 us against 27.1 at the default tiles; at T 8 the default stays best, 87 us).
# On Qwen3-30B-A3B's experts (D 2048) the batch-1 products run on the CUDA cores (block_m 1: 16 x 256 tiles, 4x the
# programs): inside the 48-layer captured step 2.640 -> 2.526 ms (and 2.857 -> 2.758 before the GEMV rules;
# bench_step_variants.py; again at the later GEMV table 2.628 -> 2.526, results/step_variants/
# core_qwen3_30b_a3b_48_fp8_block.md), though alone, kernels from HBM with no successor launched early, they are slower
# (28.2 us against 25.0, bench_weights_kernels.py's CUDA-core variants, files not kept): the step's PDL overlap favours
# more, shorter programs (likely; not measured apart). The same tiles in bf16 made the step slower (2.864 -> 3.043 ms). Wider experts keep the
# tensor-core rule below. Two warps a program (half the threads, twice the columns each): 2.424 -> 2.386 ms and 2.416
# -> 2.380 in two runs on an H100, the same bits (results/weights_bs1/tiles_*, results/l2_prefetch/variants_qwen3_48_*;
# not measured on the H200).
CORE_MOE = MoeTiles(block_m=1, up_n=16, up_k=256, down_n=16, down_k=256, warps=2)
FP8_MOE_TILE_RULES: tuple[TileRule, ...] = (
    TileRule(CORE_MOE, tokens=(1, 2), hidden=(0, 2049)),
    TileRule(MoeTiles(up_k=256, down_k=256, stages=3), tokens=(1, 2), weight=(0, 32 * 2**20)),
    TileRule(QWEN3_DOWN, tokens=(32, 65), hidden=(2048, 2049), inter=(768, 769), activations=("fp8_dynamic",)),
    TileRule(QWEN3_DOWN_W8, tokens=(32, 65), hidden=(2048, 2049), inter=(768, 769), activations=("full",)),
)


# mxfp4 experts, ahead of the rules above: one row a program, its products on the CUDA cores (quant.mx_row_mac: int32
# words of 8 codes, about 5 instructions a weight where tl.dot_scaled's tiles take 17-19 and bind the kernels by their
# instructions; experiments/results/mx_row/), on moe_experts' row grid (a program per assignment), 16 columns, 256- /
# 512-wide K steps, 3 stages: up to 8 rows, and to 16 where the experts are many (each row reads its expert again, so
# the rule holds while an expert averages about one row, T*K/E). In the 12-layer captured step on an H100
# (bench_step_variants.py, experiments/results/row_grid/), against the table before (these tiles at bs 1, 32 x 64
# columns at bs 2-8 on the slot grid, whose empty row blocks were most of its programs; tl.dot_scaled from 9 rows):
# GPT-OSS-120B 1.296 -> 1.246 ms at bs 1, 3.793 -> 3.250 at bs 8, 6.918 -> 5.253 at bs 16; GPT-OSS-20B (32 experts)
# 1.292 -> 1.245, 3.469 -> 3.128 at bs 8, but 4.427 -> 5.065 at bs 16 (2 rows an expert): there tl.dot_scaled stays.
# Before these tiles (mx_row/): GPT-OSS-120B 1.751 ms at bs 1 and 4.537 at bs 8 on 16-row tl.dot_scaled tiles. bs 3,
# 5-7 and 9-15 take the rule unmeasured (bs 2 and 4 measured: 1.757 -> 1.670, 2.636 -> 2.206 ms on GPT-OSS-120B).
# The capacity kernels read these rules with C (1 at decode sizes, so every expert on one-row tiles): GPT-OSS-120B's
# capacity kernels alone 1377 -> 717 us at C 1, its 12-layer capacity step 16.48 -> 9.58 ms at bs 1
# (experiments/results/capacity_tiles/).
MX_ROW = MoeTiles(block_m=1, up_n=16, up_k=256, down_n=16, down_k=512, stages=3)
MX_MOE_TILE_RULES: tuple[TileRule, ...] = (
    TileRule(MX_ROW, tokens=(1, 9)),
    TileRule(MX_ROW, tokens=(9, 17), experts=(64, math.inf)),
)
FORMAT_TILE_RULES = {"full": FULL_MOE_TILE_RULES, "fp8_block": FP8_MOE_TILE_RULES, "mxfp4": MX_MOE_TILE_RULES}  # by model.weights


def moe_tiles(T: int, D: int, I: int, E: int, weights: str = "full",  # noqa: E741
              activations: str = "full", kernel: str = "dropless") -> MoeTiles:
    """weights: the experts' format (model.weights: full, fp8_block, mxfp4), whose rules come first; activations:
    model.activations (fp8_dynamic: block-FP8 experts on quantized inputs); kernel: which kernels ask (KERNELS; the
    capacity kernels through capacity_tiles)."""
    if kernel not in KERNELS:
        raise ValueError(f"moe_tiles: kernel {kernel!r} is not one of {KERNELS}")
    return _first(FORMAT_TILE_RULES[weights] + MOE_TILE_RULES, DEFAULT, T, D, I, E, activations, kernel)


# The capacity kernels' tiles: the table's for C rows in the format, but where those are one row a program and C > 1
# (every expert then runs C slot blocks a column block, at decode sizes mostly empty) 32 x 64 columns, half the
# programs: GPT-OSS-120B's mxfp4 capacity kernels alone at C 3 (bs 64) 1106 us on these, 1211 on the dropless rule's
# 16 columns, 1380 on tl.dot_scaled (one H100, one call, experiments/results/capacity_tiles/).
CAPACITY_ROWS = MoeTiles(block_m=1, up_n=32, down_n=64)


def capacity_tiles(C: int, D: int, I: int, E: int, weights: str = "full",  # noqa: E741
                   activations: str = "full") -> MoeTiles:
    t = moe_tiles(C, D, I, E, weights, activations, "capacity")
    return CAPACITY_ROWS if t.block_m == 1 and C > 1 else t


# -- small-batch linears (the decode step's qkv and o projections) ------------------------------------------------
@dataclass(frozen=True)
class GemvTiles:
    block_n: int = 16  # output columns (rows of W) per program
    block_k: int = 256  # K step of the loop
    warps: int = 4
    stages: int = 4
    pdl_trigger: bool = True  # under PDL mode 2, trigger the successor's launch at the start (False: as blocks exit)
    split_k: int = 1  # K split this many ways into fp32 partial rows the consumer adds (gemv.linear_partials only)
    rows: int = 16  # rows of x per program: 16 on tl.dot (block-FP8: up to 64); fewer (1 at batch 1): CUDA-core products


@dataclass(frozen=True)
class GemvRule:
    tiles: GemvTiles
    tokens: tuple = _ANY  # T
    out: tuple = _ANY  # N
    inner: tuple = _ANY  # K

    def holds(self, T: int, N: int, K: int) -> bool:
        return _within((T, self.tokens), (N, self.out), (K, self.inner))


# Where the Triton GEMV (gemv.linear) replaces cuBLAS: first rule whose ranges hold (T, N, K); none: cuBLAS.
# Kept only where the captured step got faster on an H200 (bench_step_variants.py's tile variants): Qwen1.5's
# o (2048 x 2048) and qkv (6144 x 2048), -33 us a step at bs 1 and -52 at bs 8 over 24 layers. The K = 4096
# projections (Qwen3's o, Mixtral's qkv and o) beat cuBLAS by 1.3-2.4 us a call in bench_gemv.py, but that bench chained
# the GEMVs by PDL; inside the step they were no faster (Mixtral) or 3 us a layer slower (Qwen3), whatever the PDL
# trigger: above batch 1 they stay on cuBLAS, as every shape not listed does.
_SMALL = (1, 17)
# Batch 1, every projection (qkv, o, the shared expert's and dense MLPs' GEMMs, MLA's fused q / latent projection):
# one row a program, its products on the CUDA cores, 4 columns x 1024-wide K steps (the GEMV is latency-bound: as
# many bytes in flight per program as the loop allows). In the captured step on an H200 (bench_step_variants.py,
# experiments/results/step_variants/core_gemv_*.md), against the table before it (cuBLAS everywhere at batch 1 but
# Qwen1.5's and OLMoE's qkv and o on the tensor-core tiles below, Qwen3's on 4 x 2048 CUDA-core tiles): Qwen1.5-MoE
# 24 layers 1.905 -> 1.840 ms, DeepSeek-V2-Lite 27 layers 2.444 -> 2.290, OLMoE 16 layers 1.062 -> 0.988, GLM-4.5-Air
# 8 layers 1.714 -> 1.678, Mixtral 8 layers 1.782 -> 1.765, GPT-OSS-20B 12 layers 2.274 -> 2.201; Qwen3-30B-A3B 48
# layers 2.703 against 2.692 on 4 x 2048 (the same within noise). On the shared expert alone (the other
# projections kept on the table) it is no faster than cuBLAS (Qwen1.5 1.919 ms, 4 x 2048 tiles): the gain is the
# qkv / o and MLA projections'.
CORE_GEMV = GemvTiles(4, 1024, 4, 3, rows=1)
GEMV_RULES: tuple[GemvRule, ...] = (
    GemvRule(CORE_GEMV, tokens=(1, 2)),
    GemvRule(GemvTiles(16, 512, 4, 3), tokens=_SMALL, out=(1024, 2049), inner=(2048, 2049)),
    GemvRule(GemvTiles(32, 128, 4, 4), tokens=_SMALL, out=(6144, 6145), inner=(2048, 2049)),
)


def gemv_tiles(T: int, N: int, K: int) -> GemvTiles | None:
    return _first(GEMV_RULES, None, T, N, K)


# The block-FP8 GEMV's tiles (it serves every shape, any T: cuBLAS has no block-FP8 path). From
# experiments/bench_weights_kernels.py on an H200 (results/weights/kernels.md, Qwen3-30B-A3B's qkv 5120 x 2048 and
# o 2048 x 4096 at T 1 and 8): 512-wide K steps win (each stage moves as many bytes as a 256-wide bf16 step), 32
# columns per program for qkv (8.0 us, bf16's cuBLAS 8.2) and 16 for o, whose 2048 rows give too few programs
# otherwise (8.8-9.0 us, cuBLAS 9.5-9.7; the former 64 x 128 tiles 17.8).
# At batch 1 every block-FP8 projection on CUDA-core tiles of 4 columns x 2048-wide K steps (one row a program): on
# Qwen3-30B-A3B's qkv and o the 48-layer FP8 step 2.857 -> 2.619 ms (bench_step_variants.py on an H200, that run's
# files not kept; alone, qkv 7.0 us and o 6.3 against 8.0 and 8.8, bench_weights_kernels.py's CUDA-core variants at
# 4 x 1024); on GLM-4.5-Air (8 layers, D 4096, every projection) 1.416 -> 1.373 ms, 4 x 1024 tiles 1.393
# (experiments/results/step_variants/core_gemv_glm4_5_air_fp8_block.md). Other block-FP8 shapes are not measured.
FP8_GEMV_DEFAULT = GemvTiles(32, 512, 4, 3)
CORE_GEMV_FP8 = GemvTiles(4, 2048, 4, 2, rows=1)
FP8_GEMV_RULES: tuple[GemvRule, ...] = (
    GemvRule(CORE_GEMV_FP8, tokens=(1, 2)),
    GemvRule(GemvTiles(16, 512, 4, 3), out=(0, 2049), inner=(4096, math.inf)),
)


# With fp8_dynamic activations (a8) the tensor-core tiles step K by 128 (one FP8 MMA and its two scales a step,
# quant.act_k), so each stage moves a quarter of the bytes of the 512-wide steps above: six stages and wider column
# blocks keep as many bytes in flight. bench_weights_kernels.py --activations fp8_dynamic on an H100 (T 8,
# experiments/results/activations/kernels_a8.md): qkv 5120 x 2048 8.4 us on 64 columns x 6 stages against 9.7 on the
# table's 32 x 3; o 2048 x 4096 11.4 on 32 x 6 against 15.0 on 16 x 3; every column width ran faster with 6 stages than
# 4 and with 4 than 3; split-K (2, 4) slower (a split kernel then compiled without its pipelined loads: see
# docs/results.md, "Split-K kernels as compiled before a24efe6"). The same tiles up to 32 rows (16 a program; the
# programs of the other row block find the weights in L2), where the 3-stage W8A16 tiles served 17-32 before: alone (one
# H100, experiments/results/fp8_gemv_rows/) qkv 8.9 -> 7.8 us and o 13.8 -> 10.0 at T 32; the 24-layer Qwen3-30B-A3B
# step at bs 32 6.258 -> 6.136 ms, and 5.879 -> 5.750 with the down tiles of QWEN3_DOWN, on two H100s. At 64 rows they
# are faster alone too (qkv 14.1 -> 11.2, o 27.6 -> 12.2), but the step was slower with them in both runs (10.081 ->
# 10.303, 8.511 -> 8.615 ms; not understood, not measured apart), so 33-64 rows keep the W8A16 tiles.
FP8_A8_GEMV_RULES: tuple[GemvRule, ...] = (
    GemvRule(GemvTiles(32, 128, 4, 6), tokens=(2, 33), out=(0, 2049)),
    GemvRule(GemvTiles(64, 128, 4, 6), tokens=(2, 33)),
)


def fp8_gemv_tiles(T: int, N: int, K: int, a8: bool = False) -> GemvTiles:
    """The block-FP8 GEMV's tiles for x [T, K] @ w [N, K]^T; a8: its inputs quantized (fp8_dynamic) first."""
    return _first((*(FP8_A8_GEMV_RULES if a8 else ()), *FP8_GEMV_RULES), FP8_GEMV_DEFAULT, T, N, K)


# The absorbed MLA step's per-head projections (gemv.head_linear): W_UK's view [H, C, Dn] of kv_b_proj (N stride 1:
# the latent columns contiguous) and W_UV's rows [H, Dv, C] (K contiguous); one program per (BLOCK_N columns, head).
# Above batch 2, and both at any T until measured otherwise: 16 rows on tl.dot.
HEAD_UK = GemvTiles(64, 128, 4, 3)
HEAD_UV = GemvTiles(16, 256, 4, 3)


def head_tiles(T: int, N: int, K: int, n_contiguous: bool) -> GemvTiles:
    """head_linear's tiles for x [T, H, K] @ w[h] [N, K]^T; n_contiguous: w's N stride is 1 (W_UK's view)."""
    return HEAD_UK if n_contiguous else HEAD_UV


# fp32 routers (DeepSeek-V2/V3, GLM: HF casts h and the weight to fp32; gemv.router_logits): the GEMV's CUDA-core
# path, one row a program (exact fp32 products; tl.dot would round them to tf32), 2 experts x 1024-wide K steps,
# in place of cuBLAS's fp32 GEMV (a dot kernel + a reduce) and the cast of h before it. None: cuBLAS.
ROUTER_GEMV = GemvTiles(2, 1024, 4, 3, rows=1)


def router_tiles(T: int, E: int, D: int) -> GemvTiles | None:
    """Up to 16 rows (one a program, each reading the small router weight again; measured at T 1 and 8); more: None."""
    return ROUTER_GEMV if T <= 16 else None


@dataclass(frozen=True)
class NormRouteTiles:
    """norm_route's experts a program (block_e) and warps: every program of a row loads the whole row and its experts'
    router rows, and the row's last one runs the softmax / top-k over the row's logits; warp_topk: that last phase
    on a [warps, experts] copy of the logits, one row a warp, so its reductions stay inside a warp (64-128 experts:
    one warp holds a row in 4-wide loads; fewer had fewer barriers across the warps already). At sm_90 it takes
    Qwen3-30B-A3B's norm_route from 39 block barriers to 13 (+88 instructions); not timed yet, so off (the bench's
    variant rk=1; the softmax's sum then adds in another order)."""
    block_e: int
    warps: int = 8
    warp_topk: bool = False


def norm_route_tiles(T: int, E: int, D: int) -> NormRouteTiles:
    """About 16 programs a row, at most 16k router weights a program in registers, 8 warps."""
    def p2(n: int) -> int:
        return 1 << max(n - 1, 0).bit_length()
    return NormRouteTiles(max(2, min(p2(E) // 16, 16384 // p2(D))))


def norm_warps(T: int, D: int, KK: int) -> int:
    """Warps of add_rmsnorm's one program per row (it reads KK partial rows of D fp32, the residual and the weight).
    D <= 2048: 16, more loads in flight for a kernel that runs one program at batch 1 (H200, bench_step_variants.py's
    norm variants: the Qwen3 step -1.2% at bs 1 and -1.7% at bs 8, Qwen1.5's -2.8% and -1.5%; the sum of squares
    then adds in another order, so the bits can move within fp32 rounding); wider rows unmeasured: as before."""
    if D <= 2048:
        return 16
    return 4 if D <= 4096 else 8


@dataclass(frozen=True)
class MlaTiles:
    """Tiles of the MLA decode attention (moecg.kernels.mla): heads per program (the rows of its tensor-core tiles,
    padded to >= 16), cache slots per loop step, warps, pipeline stages, and the separate merge's partial values per
    load (splits x latent dims, fp32) and warps (one program a head and latent-dim slice)."""
    heads: int = 16
    block_l: int = 32
    warps: int = 8
    stages: int = 3
    merge_tile: int = 4096
    merge_warps: int = 4
    pdl_trigger: bool = True  # under PDL mode 2, the attention kernel triggers its successor's launch at its start


@dataclass(frozen=True)
class MlaRule:
    tiles: MlaTiles
    tokens: tuple = _ANY  # T
    heads: tuple = _ANY  # H
    slots: tuple = _ANY  # L
    work: tuple = _ANY  # T * H: rows of score tiles a step has
    latent: tuple = (512, math.inf)  # C: the table was measured at 512 latent dims (DeepSeek-V2/V3, Kimi-K2)

    def holds(self, T: int, H: int, C: int, L: int) -> bool:
        return _within((T, self.tokens), (H, self.heads), (L, self.slots), (T * H, self.work), (C, self.latent))


# From experiments/bench_mla_attn.py on the H200 (results/mla_attn/mla_attn.md; 16, 64 and 128 heads, T 1-64, 256 /
# 4k / 32k slots, every tile set x split count x merge, in CUDA graphs). 64-head blocks (M 64: Hopper's wgmma) where
# the heads x rows are many, as the score and value products then bound the kernel (V3 T 64 at 32k: 2.94 ms, 182
# TFLOP/s, against 5.52 ms with 16-head blocks); short caches: 64 slots a step, 8 warps (4.7 against 6.1 us, one
# split); else 16 heads, 32 slots, 4 warps (V2-Lite T 64 at 32k: 95% of the copy bandwidth, against 65% at 8 warps).
# Caches of 16k+ slots: 64-head blocks for 64+ heads at any row count (H100, 32k slots, with the merge kernel one
# program a head: V3 T 1 / 4 / 8 71 / 225 / 436 us against 73 / 268 / 515 with 16-head blocks, Kimi-K2 T 2 / 4 / 8
# 75 / 129 / 229 against 76 / 137 / 268; at 4k slots 16-head blocks stay as fast or faster).
MLA_RULES: tuple[MlaRule, ...] = (
    MlaRule(MlaTiles(64, 32, 8, 2), heads=(64, math.inf), slots=(0, 257), work=(8192, math.inf)),
    MlaRule(MlaTiles(16, 64, 8, 2), slots=(0, 257)),
    MlaRule(MlaTiles(64, 32, 8, 2), heads=(64, math.inf), work=(2048, math.inf)),
    MlaRule(MlaTiles(64, 32, 8, 2), heads=(64, math.inf), slots=(16384, math.inf)),
    MlaRule(MlaTiles(16, 32, 4, 3)),
)


def mla_tiles(T: int, H: int, C: int, L: int) -> MlaTiles:
    """The first MLA_RULES rule holding (T, H, C, L), else MlaTiles() at 512+ latent dims and 64 slots, 4 warps below
    (the tiny test models)."""
    return _first(MLA_RULES, MlaTiles() if C >= 512 else MlaTiles(block_l=64, warps=4), T, H, C, L)
