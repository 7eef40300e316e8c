"""Which rope_cache configuration gives Triton != the PyTorch reference bits on the GPU, and which one is off
(each against the same formula evaluated with separate fp32 ops on the CPU)."""
import torch
from moecg.kernels import ref
from moecg.kernels import triton_ops as tri

BF = torch.bfloat16
for T in (1, 8):
    g = torch.Generator(device="cuda").manual_seed(T)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(BF)  # noqa: E731
    pos = torch.tensor(300, device="cuda")
    L = 512
    for Hq, Hkv, Dh, R, norm, clip in ((96, 8, 128, 64, None, None), (96, 8, 128, 64, "head", None),
                                       (16, 16, 128, 128, "full", 4.0)):
        qkv, cos, sin = r(T, (Hq + 2 * Hkv) * Dh) * 3, r(L, R), r(L, R)
        qn = None if norm is None else r(Dh if norm == "head" else Hq * Dh)
        kn = None if norm is None else r(Dh if norm == "head" else Hkv * Dh)
        outs = []
        for dev, fn in (("cuda", ref.rope_cache), ("cuda", tri.rope_cache), ("cpu", ref.rope_cache)):
            mv = lambda x: None if x is None else x.to(dev)  # noqa: E731
            k = torch.zeros(T, Hkv, L, Dh, device=dev, dtype=BF)
            v = k.clone()
            q = fn(qkv.to(dev), pos.to(dev), cos.to(dev), sin.to(dev), k, v, Hq, Hkv, Dh, mv(qn), mv(kn), clip=clip)
            outs.append((q.cpu(), k.cpu()))
        (q1, k1), (q2, k2), (q3, k3) = outs
        f = lambda a, b: float((a != b).float().mean())  # noqa: E731
        print(f"T={T} norm={norm} R={R}: q ref-cuda vs tri {f(q1, q2):.4f}, ref-cuda vs ref-cpu {f(q1, q3):.4f}, "
              f"tri vs ref-cpu {f(q2, q3):.4f}; k: {f(k1, k2):.4f} {f(k1, k3):.4f} {f(k2, k3):.4f}", flush=True)
