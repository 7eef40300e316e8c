"""Capture's precompile pass (kernels=fused on Triton): a step run dry records its launches, then each distinct
specialisation compiles once on a thread pool. On CPU no kernel launches or compiles: the recording, the zeros
the ops return while dry, the specialisation keys and the pool are checked with the real op wrappers and a stand-in
kernel; tests/test_fast_gpu.py checks on CUDA that the warmups after it compile nothing and the bits are unchanged."""
from __future__ import annotations

import threading

import pytest
import torch

triton = pytest.importorskip("triton")

from moecg.capture import Capture, StrategyError  # noqa: E402
from moecg.dispatch import attach, detach, make_dispatcher, state_of  # noqa: E402
from moecg.engine import DecodeEngine  # noqa: E402
from moecg.kernels import launch, triton_ops  # noqa: E402
from moecg.models import build_model  # noqa: E402


class _Kernel:
    """A stand-in JIT function: records warmups (thread, args) and indexing launches."""

    def __init__(self, arg_names, do_not_specialize=()):
        self.arg_names, self.do_not_specialize = list(arg_names), list(do_not_specialize)
        self.warmups, self.launched, self.inits = [], [], 0
        self.lock = threading.Lock()

    def warmup(self, *args, grid, **kwargs):
        with self.lock:
            self.warmups.append((threading.current_thread().name, args, kwargs))
        kernel = self

        class Compiled:
            def _init_handles(self):
                with kernel.lock:
                    kernel.inits += 1
        return Compiled()

    def __getitem__(self, grid):
        return lambda *a, **k: self.launched.append((grid, a, k))


def test_launch_runs_outside_dry_run_and_records_inside():
    k = _Kernel(["x", "T"])
    x = torch.zeros(4)
    launch.launch(k, (2,), x, 3, BLOCK=8)
    assert len(k.launched) == 1 and k.launched[0][0] == (2,)
    with triton_ops.dry_run() as rec:
        launch.launch(k, (5,), x, 3, BLOCK=8)
        with pytest.raises(RuntimeError, match="already active"):
            with triton_ops.dry_run():
                pass
    assert len(k.launched) == 1 and len(rec) == 1 and rec[0][1] == (5,)
    assert launch._DRY is None


def test_dry_ops_record_and_return_zeros():
    """The real op wrappers on CPU tensors: inside dry_run nothing launches (a launch on CPU tensors would raise)
    and the outputs are zeros; batch sizes share a key (T is not specialised), other constexprs do not."""
    D = 64
    w = torch.randn(D)
    keys = []
    with triton_ops.dry_run() as rec:
        for T in (1, 64):
            y = torch.randn(T, 1, D)
            res, h = triton_ops.add_rmsnorm(y, None, w, 1e-6, out_dtype=torch.float32)
            assert torch.count_nonzero(res) == 0 and torch.count_nonzero(h) == 0
            res2, h2 = triton_ops.add_rmsnorm(y, torch.randn(T, D), w, 1e-6)
            assert torch.count_nonzero(h2) == 0
        logits = torch.randn(3, 16)
        idx, wt = triton_ops.route(logits, 4, True, torch.float32)
        assert idx.dtype == torch.int64 or idx.dtype == torch.int32
        assert torch.count_nonzero(idx) == 0 and torch.count_nonzero(wt) == 0
        _, h3, (q, s) = triton_ops.add_rmsnorm(torch.randn(2, 1, D), None, w, 1e-6, quant=True)  # nested outputs
        assert not torch.count_nonzero(h3) and not torch.count_nonzero(q.view(torch.uint8))
        assert not torch.count_nonzero(s)
    assert len(rec) == 6
    rec = rec[:5]
    keys = [launch._spec_key(k, a, kw) for k, _, a, kw in rec]
    assert keys[0] == keys[2] and keys[1] == keys[3]  # T=1 and T=64: one specialisation each
    assert keys[0] != keys[1]  # with and without a residual: two
    assert len(set(keys)) == 3


def _precompile(launches) -> dict:
    pre = triton_ops.Precompiler()
    for args in launches:
        pre.submit(*args)
    return pre.wait()


def test_precompile_dedupes_and_builds_launchers_on_threads():
    k = _Kernel(["x", "T", "D"], do_not_specialize=["T"])
    x = torch.zeros(8)
    launches = [(k, (1,), (x, 1, 64), {"BLOCK": 16}), (k, (64,), (x, 64, 64), {"BLOCK": 16}),  # one key (T free)
                (k, (1,), (x, 1, 64), {"BLOCK": 32}),  # another constexpr
                (k, (1,), (x, 1, 40), {"BLOCK": 16})]  # D 40: not a multiple of 16, specialised apart
    got = _precompile(launches)
    assert got["launches"] == 4 and got["specialisations"] == 3
    assert len(k.warmups) == 3 and k.inits == 3
    assert all(name.startswith("moecg-precompile") for name, _, _ in k.warmups)
    assert sorted(kw["BLOCK"] for _, _, kw in k.warmups) == [16, 16, 32]


def test_precompile_hashes_triton_beside_the_dry_pass_and_before_any_compile(monkeypatch, tmp_path):
    """Triton's hash of its own sources runs once, on a thread of its own started by the Precompiler (the dry pass
    goes on meanwhile); every compile waits for it."""
    import time

    import triton.runtime.cache as cache

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # no key file yet

    ready, calls = threading.Event(), []

    def slow_key():
        calls.append(threading.current_thread().name)
        time.sleep(0.3)
        ready.set()
        return "key"

    monkeypatch.setattr(cache, "triton_key", slow_key)

    class Waits(_Kernel):
        def warmup(self, *args, grid, **kwargs):
            assert ready.is_set(), "a compile started before Triton's source hash was ready"
            return super().warmup(*args, grid=grid, **kwargs)

    t0 = time.perf_counter()
    pre = launch.Precompiler()
    assert time.perf_counter() - t0 < 0.2  # not waited for here: the dry pass records meanwhile
    k = Waits(["x"])
    pre.submit(k, (1,), (torch.zeros(2),), {})
    pre.submit(k, (1,), (torch.zeros(2),), {"BLOCK": 8})
    got = pre.wait()
    assert calls == ["moecg-triton-key"] and got["specialisations"] == 2 and len(k.warmups) == 2


def test_triton_key_file_spares_the_next_process_the_hash(monkeypatch, tmp_path):
    """The source hash a Precompiler computed is kept in Triton's cache directory with the package's fingerprint; a
    later process (here: triton_key not computed yet) reads it instead of hashing, and starts no hashing thread; another
    fingerprint or a damaged file means hashing again."""
    import triton.runtime.cache as cache

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    calls = []

    def fresh(value):  # a process's own triton_key, not computed yet
        def key():
            calls.append(value)
            return value
        return key

    monkeypatch.setattr(cache, "triton_key", fresh("k1"))
    assert not launch.load_triton_key()
    pre = launch.Precompiler()
    pre.wait()
    assert calls == ["k1"] and (tmp_path / launch.TRITON_KEY_FILE).exists()

    monkeypatch.setattr(cache, "triton_key", fresh("k2"))  # the next process
    assert launch.load_triton_key() and cache.triton_key() == "k1" and calls == ["k1"]
    monkeypatch.setattr(cache, "triton_key", fresh("k2"))
    assert launch.Precompiler()._key is None and cache.triton_key() == "k1"

    monkeypatch.setattr(cache, "triton_key", fresh("k2"))
    monkeypatch.setattr(launch, "_triton_fingerprint", lambda: "another package")
    assert not launch.load_triton_key()
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "triton_key", fresh("k3"))
    (tmp_path / launch.TRITON_KEY_FILE).write_text("half a file")
    assert not launch.load_triton_key() and cache.triton_key() == "k3"


def test_triton_fingerprint_follows_the_package_files(monkeypatch, tmp_path):
    """The key file's fingerprint changes with any .py / .so file of the Triton package: its size, its modification
    time, a file added; and with the package's place (another install)."""
    import os

    import triton

    pkg = tmp_path / "triton"
    (pkg / "_C").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "_C" / "libtriton.so").write_bytes(b"\0" * 64)
    monkeypatch.setattr(triton, "__file__", str(pkg / "__init__.py"))
    first = launch._triton_fingerprint()
    assert launch._triton_fingerprint() == first
    (pkg / "_C" / "libtriton.so").write_bytes(b"\0" * 65)
    second = launch._triton_fingerprint()
    st = os.stat(pkg / "__init__.py")
    os.utime(pkg / "__init__.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    third = launch._triton_fingerprint()
    (pkg / "language.py").write_text("")
    fourth = launch._triton_fingerprint()
    (pkg / "notes.txt").write_text("not hashed by Triton")
    assert launch._triton_fingerprint() == fourth
    other = tmp_path / "elsewhere" / "triton"
    other.parent.mkdir()
    pkg.rename(other)
    monkeypatch.setattr(triton, "__file__", str(other / "__init__.py"))
    assert len({first, second, third, fourth, launch._triton_fingerprint()}) == 5


def test_precompile_propagates_compile_errors():
    class Bad(_Kernel):
        def warmup(self, *args, grid, **kwargs):
            raise ValueError("does not compile")
    with pytest.raises(ValueError, match="does not compile"):
        _precompile([(Bad(["x"]), (1,), (torch.zeros(2),), {})])


@pytest.mark.parametrize("preset,ragged", [("qwen2_moe_tiny", False), ("qwen3_moe_tiny", False),
                                           ("mixtral_tiny", False), ("qwen3_moe_tiny", True)])
def test_capture_precompile_pass_runs_every_bucket_dry(preset, ragged, monkeypatch):
    """Capture._precompile with the Triton ops on CPU: every bucket's whole step runs dry (the torch ops between the
    kernels run on zeros without error), every op kind of the step is recorded, and the engine's cache lengths and
    counters are as before."""
    model = build_model(preset, dtype="bf16", device="cpu", seed=0).model
    attach(model, make_dispatcher("fused"), max_rows=4)
    try:
        if ragged:  # the serving engine: per-row positions on its own cache
            from moecg.ragged import RaggedEngine
            eng = RaggedEngine(model, 32, 4)
        else:
            eng = DecodeEngine(model, 32, 4)
        cap = Capture(eng, "full", buckets=(1, 2, 4), backend="emulate", kernels="fused")
        cap.fast.ops, cap.fast.backend = triton_ops, "triton"
        built = []  # what the pool would compile (no CUDA here): one call per distinct specialisation
        monkeypatch.setattr(launch, "_build", lambda kernel, grid, args, kwargs: built.append(kernel.__name__))
        seen = []
        real_launch = launch.launch
        for mod in triton_ops.MODULES:  # every kernel module's launches
            monkeypatch.setattr(mod, "launch", lambda k, g, *a, **kw: (seen.append(k.__name__),
                                                                       real_launch(k, g, *a, **kw)))
        eng.decode_forward = cap.fast
        lengths = eng.cache.save_lengths()
        before = state_of(model).snapshot()
        cap._precompile([4, 2, 1])
        n_layers = len(cap.fast.layers)
        assert {"_add_rmsnorm_kernel", "_rope_cache_kernel", "_attn_decode_kernel"} <= set(seen)
        assert set(seen) & {"_route_kernel", "_norm_route_kernel"}
        assert seen.count("_attn_decode_kernel") == 3 * n_layers  # every layer of every bucket
        assert cap.precompiled["launches"] == len(seen) and cap.precompiled["specialisations"] == len(built)
        assert set(built) == set(seen) and len(built) < len(seen) / 3  # each kernel once per key, not per launch
        after = eng.cache.save_lengths()
        assert all(torch.equal(a, b) for a, b in zip(after, lengths)) if isinstance(lengths, (list, tuple)) \
            else torch.equal(after, lengths)
        assert state_of(model).snapshot() == before
        # a second Capture of the same step in this process (a sweep's next point) skips the dry pass; other buckets
        # do not
        cap2 = Capture(eng, "full", buckets=(1, 2, 4), backend="emulate", kernels="fused")
        cap2.fast.ops, cap2.fast.backend = triton_ops, "triton"
        eng.decode_forward = cap2.fast
        n = len(seen)
        cap2._precompile([4, 2, 1])
        assert len(seen) == n and cap2.precompiled["launches"] == 0 and "skipped" in cap2.precompiled
        cap2._precompile([2, 1])
        assert len(seen) > n and cap2.precompiled["launches"] == len(seen) - n
        # other kernel specialisations (weights loaded after the PDL wait: capture.preload false) run it again
        n = len(seen)
        cap2.fast.preload = False
        cap2._precompile([4, 2, 1])
        assert len(seen) > n and "skipped" not in cap2.precompiled
    finally:
        eng.decode_forward = None
        detach(model)


def test_every_launch_goes_through_launch_and_every_op_returns_dry_zeros():
    """The dry pass is only safe and complete if no kernel is launched directly (`kernel[grid](...)`) and every public
    op that launches returns zeros while dry (@dry_zeros); a new kernel that skips either fails here."""
    import ast
    import inspect

    for mod in triton_ops.MODULES:
        tree = ast.parse(inspect.getsource(mod))
        direct = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
                  and n.value.id.endswith("_kernel")]
        assert not direct, f"{mod.__name__}: kernel[grid] launches at lines {direct}; use launch(kernel, grid, ...)"
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
                continue
            launches = any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "launch" for n in ast.walk(fn))
            decorated = any(getattr(d, "id", None) == "dry_zeros" for d in fn.decorator_list)
            assert decorated or not launches, f"{mod.__name__}.{fn.name} launches kernels but is not @dry_zeros"


def test_triton_ops_expose_the_reference_ops():
    """get_ops' two backends are interchangeable: triton_ops has every op of moecg.kernels.OPS, each taking the
    reference's parameters in the same order (a Triton op may add tuning keywords after them)."""
    import inspect

    from moecg.kernels import OPS, ref

    for name in OPS:
        want = list(inspect.signature(getattr(ref, name)).parameters)
        got = list(inspect.signature(getattr(triton_ops, name)).parameters)
        assert got[:len(want)] == want, (name, want, got)


def test_capture_warmup_auto_is_none_after_the_dry_pass(monkeypatch):
    """capture.warmup=auto: 3 eager runs before each capture (HF's modules, a fused step not precompiled), none once
    the precompile's dry pass has run the step, 1 where that pass was skipped (run earlier in the process: a kernel it
    did not record compiles in the warmup, not in the capture); an explicit count is kept; anything else is refused
    before any work."""
    model = build_model("qwen3_moe_tiny", dtype="bf16", device="cpu", seed=0).model
    attach(model, make_dispatcher("fused"), max_rows=4)
    try:
        eng = DecodeEngine(model, 32, 4)
        for kw, want in (({}, 3), ({"kernels": "fused"}, 3), ({"kernels": "fused", "warmup": 2}, 2)):
            cap = Capture(eng, "full", buckets=(1, 2), backend="emulate", **kw).apply()
            assert cap.stats()["warmup"] == want, kw
            cap.unwrap()
        for warmup, want in (("auto", 0), (3, 3), ("auto", 1)):  # a step taken for the Triton one (its ops stay
            # the reference's, which run on CPU): the dry pass runs before the warmups, once a process
            cap = Capture(eng, "full", buckets=(1, 2), backend="emulate", kernels="fused", warmup=warmup)
            cap.fast.backend = "triton"
            runs = []
            real = cap.runner.backend.warmup
            monkeypatch.setattr(cap.runner.backend, "warmup", lambda fn, args, n: (runs.append(n), real(fn, args, n)))
            cap.apply()
            assert cap.precompiled is not None and cap.stats()["warmup"] == want and set(runs) == {want}
            assert ("skipped" in cap.precompiled) is (warmup != "auto" or want == 1)
            cap.unwrap()
        for bad in (0, "3", True, 1.5):
            with pytest.raises(StrategyError, match="capture.warmup"):
                Capture(eng, "full", buckets=(1,), backend="emulate", warmup=bad)
    finally:
        detach(model)
