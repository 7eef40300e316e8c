"""What the compiler makes of the W8A8 kernels' K loops, on a CPU: each kernel compiled for sm_90 with Triton's bundled
ptxas (as a launch specialises it: 16-byte aligned pointers, strides and sizes multiples of 16) and disassembled with
its nvdisasm; per kernel its shared memory and its K loop's SASS instruction mix.

  python experiments/sass_loops.py --out experiments/results/gemv_split/sass_loops.md
  python experiments/sass_loops.py --mxfp4 --out experiments/results/mx_row/sass_loops.md

Rows: the A8 GEMV at the tiles its table (moecg.kernels.tiles.fp8_gemv_tiles) picks for Qwen3-30B-A3B's qkv and o
projections at bs 8, the dropless MoE up / down kernels at their A8 tensor-core tiles (block_m 16), and two probes of
the A8 loop's core (_probe_kernel): each step's MMA result scaled at once or in the next iteration.
What the mix tells: QGMMA is wgmma on e4m3 operands as stored; HMMA with F2FP is mma.sync on operands converted to fp16
first; LDGSTS are the pipelined tile loads (cp.async); LDG are plain loads inside the loop, which the step's arithmetic
waits on. `wgmma waits` lists the `pendings` of each wgmma wait in the kernel's TritonGPU IR: 0 is a wait for every
MMA issued, so no MMA stays in flight past the step that issued it. No GPU: the counts are static, one per
instruction in the loop body, not issue counts or time.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_capacity_kernel import SM90_DIV16, SM90_F8, compile_sm90  # noqa: E402  (the sm_90 compile the tests check)

from moecg.kernels import gemv, moe  # noqa: E402
from moecg.kernels.quant import act_k  # noqa: E402
from moecg.kernels.sass import bundled_tool  # noqa: E402
from moecg.kernels.tiles import fp8_gemv_tiles  # noqa: E402

KEEP = ("QGMMA", "HMMA", "F2FP", "LDGSTS", "LDG", "LDS", "LDSM", "FMUL", "FFMA", "BAR", "WARPSYNC")


def loop_mix(cubin: bytes) -> tuple[int, collections.Counter]:
    """The SASS of cubin's K loop (the longest branch back to a label above it with an MMA between; else the longest):
    (instructions, opcode counts)."""
    nvdisasm = bundled_tool("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    label = {m.group(1): i for i, line in enumerate(sass) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    loops = [(label[m.group(1)], i) for i, line in enumerate(sass)
             if (m := re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)) and label.get(m.group(1), len(sass)) < i]
    mma = [p for p in loops if any(re.search(r"\b[QH](G)?MMA\b", line) for line in sass[p[0]:p[1] + 1])]
    lo, hi = max(mma or loops, key=lambda p: p[1] - p[0])  # the K loop: the longest loop with an MMA in it
    body = [line.split("*/", 1)[1] for line in sass[lo:hi + 1] if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    ops = collections.Counter(re.sub(r"^\s*(@!?U?P\w+\s+)?", "", b).split()[0].split(".")[0] for b in body)
    return len(body), ops


@triton.jit
def _probe_kernel(w_ptr, q_ptr, ws_ptr, y_ptr, K, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, LATE: tl.constexpr):
    """A probe, not a moecg kernel: the A8 loop's core (an e4m3 [BLOCK_N, 128] x [BLOCK_M, 128]^T dot a K step, its
    fp32 result times the rows' block scale, added up), the scaling of each step's result at once (LATE 0) or in the
    next iteration (LATE 1: DeepGEMM's order, which would leave the MMA in flight across the step if the compiler
    let it)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    dp = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    sp = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + n[:, None] * K + k0 + kk[None, :])
        q = tl.load(q_ptr + m[:, None] * K + k0 + kk[None, :])
        s = tl.load(ws_ptr + n * (K // BLOCK_K) + k0 // BLOCK_K)
        d = tl.dot(w, tl.trans(q))
        if LATE:
            acc = acc + dp * sp[:, None]
            dp = d
            sp = s
        else:
            acc = acc + d * s[:, None]
    acc = acc + dp * sp[:, None]
    tl.store(y_ptr + n[:, None] * BLOCK_M + m[None, :], acc)


def kernels():
    """(name, Triton kernel, constexprs, stages) of each row."""
    for name, N, K in (("qkv", 5120, 2048), ("o", 2048, 4096)):  # Qwen3-30B-A3B's projections at bs 8
        t = fp8_gemv_tiles(8, N, K, a8=True)
        yield (f"A8 GEMV, {name} ({N} x {K}): {t.block_n} columns x 16 rows", gemv._gemv_kernel,
               dict(HAS_BIAS=False, BLOCK_T=16, BLOCK_N=t.block_n, BLOCK_K=act_k(t.block_k, 16), USE_PDL=2, QROWS=128,
                    A8=1, SPLIT=1, PRELOAD=1, s_wk=1, s_sk=1), t.stages)
    moe_a8 = dict(K=8, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_S=64, USE_PDL=2, QROWS=128, A8=1,
                  MX=0, s_wk=1, s_sk=1)
    yield ("MoE up 64 columns x 16 rows", moe._moe_up_kernel,
           dict(moe_a8, HAS_VALID=False, COUNT=False, JM=1, JU=768, ACT=0, PAIRED=0), 4)
    yield "MoE down 64 columns x 16 rows", moe._moe_down_kernel, dict(moe_a8, HAS_VALID=False, SPLIT=1, PRELOAD=1), 4
    for late in (0, 1):  # is an MMA left in flight when its result is scaled one step later?
        yield (f"probe: 64 x 16 e4m3 dot a step, scaled {'a step later' if late else 'at once'}", _probe_kernel,
               dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, LATE=late), 6)


MX_KEEP = ("FFMA", "FMUL", "HADD2", "LOP3", "IMAD", "SHF", "PRMT", "HMUL2", "HMMA", "LDG", "LDGSTS", "LDS", "STS")


def mx_kernels():
    """(name, Triton kernel, constexprs, stages, weights a thread takes a loop iteration) of the mxfp4 rows: GPT-OSS's
    experts (interleaved clamped SwiGLU, biases), 16 output columns x 256-wide K steps, one row a program on the CUDA
    cores (quant.mx_row_mac) and 16 rows on tl.dot_scaled."""
    for bm in (1, 16):
        c = dict(K=4, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=16, BLOCK_K=256, BLOCK_S=64, USE_PDL=2, QROWS=0, A8=0, MX=1,
                 s_wk=1, s_sk=1, HAS_VALID=False)
        how = "one row, CUDA cores" if bm == 1 else "16 rows, tl.dot_scaled"
        yield (f"MoE up, 16 gate + 16 up columns x 256, {how}", moe._moe_up_kernel,
               dict(c, COUNT=False, JM=2, JU=1, ACT=1, PAIRED=0), 3, 2 * 16 * 256 // 128)
        yield f"MoE down, 16 columns x 256, {how}", moe._moe_down_kernel, dict(c, SPLIT=1, PRELOAD=1), 3, 16 * 256 // 128


def a8_table() -> list[str]:
    lines = [f"sm_90 SASS of the W8A8 kernels' K loops, compiled on a CPU with Triton {triton.__version__}'s ptxas "
             "(`experiments/sass_loops.py`); counts of instructions in the loop body, not time", "",
             f"| kernel | stages | shared KB | loop instructions | {' | '.join(KEEP)} | wgmma waits |",
             "|---" * (5 + len(KEEP)) + "|"]
    for name, fn, consts, stages in kernels():
        k = compile_sm90(fn, consts, stages, div16=SM90_DIV16, **SM90_F8)
        n, ops = loop_mix(k.asm["cubin"])
        waits = re.findall(r"warp_group_dot_wait\b[^\n]*pendings = (\d+)", k.asm["ttgir"])
        lines.append(f"| {name} | {stages} | {k.metadata.shared / 1024:.0f} | {n} | "
                     + " | ".join(str(ops.get(o, 0)) for o in KEEP) + f" | {', '.join(waits) or '-'} |")
        print(lines[-1], flush=True)
    return lines


def mx_table() -> list[str]:
    lines = [f"sm_90 SASS of the mxfp4 MoE kernels' K loops, compiled on a CPU with Triton {triton.__version__}'s "
             "ptxas (`experiments/sass_loops.py --mxfp4`), 4 warps; instructions in the loop body (not time) and "
             "per weight a thread takes an iteration", "",
             f"| kernel | loop instructions | a weight | {' | '.join(MX_KEEP)} |", "|---" * (3 + len(MX_KEEP)) + "|"]
    for name, fn, consts, stages, per in mx_kernels():
        k = compile_sm90(fn, consts, stages, div16=SM90_DIV16, w_ptr="*u8", ws_ptr="*u8")
        n, ops = loop_mix(k.asm["cubin"])
        lines.append(f"| {name} | {n} | {n / per:.1f} | " + " | ".join(str(ops.get(o, 0)) for o in MX_KEEP) + " |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--mxfp4", action="store_true", help="the mxfp4 MoE loops instead (instructions a weight)")
    args = ap.parse_args()
    lines = mx_table() if args.mxfp4 else a8_table()
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
