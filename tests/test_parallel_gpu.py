"""moecg.parallel on GPUs: NCCL ranks, the all-to-alls inside real CUDA graphs, megatron-core's dispatchers.

Skipped without 2 (or 4) GPUs. On a multi-GPU host: `pytest -m gpu -s tests/test_parallel_gpu.py`. The cases are
tests/ep_worker.py's (fp32, so tokens compare exactly): each rank's expert-parallel decode, captured with
capture.backend=cuda where the strategy captures, against one process's eager decode of the same rows, plus
megatron-core's MoEAlltoAllTokenDispatcher (dropless, eager and under partial) and MoEAllGatherTokenDispatcher.
"""
from __future__ import annotations

import json

import pytest
import torch

import ep_worker

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _need(n):
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs (found {GPUS})")


@pytest.fixture(scope="module", params=[pytest.param(2, marks=_need(2)), pytest.param(4, marks=_need(4))],
                ids=["ep2", "ep4"])
def ranks(request, tmp_path_factory):
    from test_parallel import _spawn_on

    return request.param, _spawn_on(request.param, "gpu", tmp_path_factory.mktemp(f"gpu{request.param}"), "cuda")


@pytest.mark.parametrize("case", ep_worker.CASES_GPU, ids=ep_worker.case_id)
def test_gpu_ep_decode_equals_one_process(ranks, case):
    from test_parallel import _check

    world, results = ranks
    _check(results, case, world)
    print(f"ep{world} {ep_worker.case_id(case)}: tokens equal, max logit diff "
          f"{max(r[ep_worker.case_id(case)]['max_logit_diff'] for r in results.values()):.2e}")


@_need(2)
def test_gpu_torchrun_ep2_full_graphs(tmp_path):
    from test_parallel import QUICK, _torchrun

    p = _torchrun(tmp_path, 2, "parallel.ep=2", "batch_size=3", "strategy=full", "dispatch=capacity", *QUICK,
                  f"hydra.run.dir={tmp_path / 'job'}", timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((tmp_path / "job" / "results.json").read_text())
    assert (res["status"], res["ep"], res["ep_backend"], res["captured"], res["capture_backend"]) == \
        ("ok", 2, "nccl", True, "cuda")
    assert res["token_agreement_forced_vs_eager"] > 0.9 and res["exchange_floor_ms"] > 0
