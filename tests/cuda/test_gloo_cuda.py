"""Two gloo ranks sharing ``cuda:0`` (spawned; LOCAL_RANK 0 on both, so the engine puts both on ``cuda:0``): which
ops gloo carries with CUDA tensors in this torch, and the engine at ZeRO 0-3 against the CPU reference where it can.

gloo stages a CUDA tensor through host memory for the ops it implements on CUDA (all_reduce and broadcast are
documented; all_gather has a CUDA path too); for the others it refuses the tensor, or — send/recv — may read the
device pointer as host memory, so every op whose support is unknown is probed in its own group of processes. An
engine stage that fails with the error of an op gloo refuses is skipped with that reason; any other failure fails.
Run in its own pytest process (gpu_check's ``gloo-cuda`` check).
"""

from __future__ import annotations

import pytest
import torch
from cases import FP32_ATOL
from cuda_support import RankFailure, requires_cuda, run_spawned_ranks
from multi_cases import probe_ops, zero_parity

pytestmark = [pytest.mark.cuda, requires_cuda]

DOCUMENTED = ["all_reduce", "broadcast", "all_gather_into_tensor"]
UNKNOWN = ["reduce_scatter_tensor", "batch_isend_irecv"]  # each in its own group: a crash stays contained


@pytest.fixture(scope="module")
def gloo_cuda_ops(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """op → "ok" or why not, as both ranks saw it."""
    found: dict[str, str] = {}
    for names in [DOCUMENTED, *([name] for name in UNKNOWN)]:
        tmp = tmp_path_factory.mktemp("probe")
        try:
            ranks = run_spawned_ranks(probe_ops, 2, tmp, names, backend="gloo", shared_gpu=True, deadline_s=90)
        except RankFailure as failure:
            found.update(dict.fromkeys(names, f"a rank failed: {failure.messages()[0].splitlines()[0][:200]}"))
            continue
        for name in names:
            found[name] = ranks[0][name] if ranks[0][name] == ranks[1][name] else f"ranks disagree: {ranks}"
    return found


def test_gloo_carries_the_documented_ops_with_cuda_tensors(gloo_cuda_ops: dict[str, str]) -> None:
    assert {name: gloo_cuda_ops[name] for name in DOCUMENTED} == dict.fromkeys(DOCUMENTED, "ok")


@pytest.mark.parametrize("op", UNKNOWN)
def test_gloo_op_with_cuda_tensors(gloo_cuda_ops: dict[str, str], op: str) -> None:
    if gloo_cuda_ops[op] != "ok":
        pytest.skip(f"gloo (torch {torch.__version__}) with CUDA tensors: {op}: {gloo_cuda_ops[op]}")


@pytest.fixture(scope="module")
def zero_on_shared_gpu(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict]]:
    return run_spawned_ranks(zero_parity, 2, tmp_path_factory.mktemp("zero"), [0, 1, 2, 3], backend="gloo")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_with_gloo_ranks_on_one_gpu(
    zero_on_shared_gpu: list[dict[int, dict]], gloo_cuda_ops: dict[str, str], stage: int
) -> None:
    runs = [ranks[stage] for ranks in zero_on_shared_gpu]
    errors = [run["error"] for run in runs if run["error"]]
    if errors:
        refused = {op: why for op, why in gloo_cuda_ops.items() if why != "ok"}
        for op, why in refused.items():
            detail = why.split(": ", 1)[-1][:60]
            if detail and detail in errors[0]:
                pytest.skip(f"stage {stage} needs {op}, which gloo refuses with CUDA tensors: {why}")
        raise AssertionError(f"stage {stage} failed on gloo + cuda:0: {errors[0]}\n{runs[0].get('trace', '')}")
    for rank, run in enumerate(runs):
        assert run["device"] == "cuda:0", (rank, run)  # both ranks really on the shared GPU
        assert run["diff"] <= FP32_ATOL and run["norm_rel"] <= 1e-5, (rank, run)
