"""Run by tests/test_ragged_fused.py under TRITON_INTERPRET=1: rope_cache and attn_decode with one position per row
(pos [T], moecg.ragged) against their references, on CPU tensors (fp32): partial rotary, q/k norms, windows, sinks,
the eager rounding, and a split context. Prints ALL OK when every check passes; any mismatch raises. Kept out of
pytest collection (no test_ prefix) because TRITON_INTERPRET must be set before triton is imported.
Dims: T rows, Hq/Hkv heads, Dh head dim, R rotary dims, L cache slots.
"""
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from moecg.kernels import ref  # noqa: E402
from moecg.kernels import triton_ops as tri  # noqa: E402

from interp_common import close  # noqa: E402 (tests/, this script's directory)


torch.manual_seed(0)
T, L = 3, 256
pos = torch.tensor([37, 0, 200])
for Hq, Hkv, Dh, R, norm in ((4, 2, 32, 16, None), (4, 2, 32, 32, "head"), (4, 4, 32, 32, "full")):
    qkv = torch.randn(T, (Hq + 2 * Hkv) * Dh)
    cos, sin = torch.randn(L, R), torch.randn(L, R)
    qn = None if norm is None else torch.randn(Dh if norm == "head" else Hq * Dh)
    kn = None if norm is None else torch.randn(Dh if norm == "head" else Hkv * Dh)
    k1, v1 = torch.zeros(T, Hkv, L, Dh), torch.zeros(T, Hkv, L, Dh)
    k2, v2 = k1.clone(), v1.clone()
    close(ref.rope_cache(qkv, pos, cos, sin, k1, v1, Hq, Hkv, Dh, qn, kn),
          tri.rope_cache(qkv, pos, cos, sin, k2, v2, Hq, Hkv, Dh, qn, kn))
    close(k1, k2)
    close(v1, v2)
    assert (k2 != 0).any(-1).any(1).nonzero().tolist() == [[t, int(p)] for t, p in enumerate(pos)]

Hq, Hkv, Dh = 8, 2, 32
q, keys, vals, sinks = torch.randn(T, Hq, Dh), torch.randn(T, Hkv, L, Dh), torch.randn(T, Hkv, L, Dh), torch.randn(Hq)
for window, sk, eager in ((0, None, False), (64, None, False), (0, sinks, False), (64, sinks, True), (0, None, True)):
    close(ref.attn_decode(q, keys, vals, pos, 0.2, window, sinks=sk, eager=eager),
          tri.attn_decode(q, keys, vals, pos, 0.2, window, sinks=sk, eager=eager))
# a long context (> LONG_SPAN slots): attn_splits' long rule, 64 splits merged (per-row positions, sinks)
T2, L2 = 2, 8192
assert tri.attn_splits(T2, 2, L2) == 64
q2, k2, v2 = torch.randn(T2, 4, 32), torch.randn(T2, 2, L2, 32), torch.randn(T2, 2, L2, 32)
pos2 = torch.tensor([8000, 4100])
for sk in (None, torch.randn(4)):
    close(ref.attn_decode(q2, k2, v2, pos2, 0.2, sinks=sk), tri.attn_decode(q2, k2, v2, pos2, 0.2, sinks=sk))
print("ALL OK")
