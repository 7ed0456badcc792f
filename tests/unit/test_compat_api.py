"""DeepSpeed's module-level API under shardspeed: every name of tests/compat/deepspeed_signatures.json exists with
DeepSpeed's parameters, and each behaves (accelerator on CPU, comm on one and two ranks, the Adam/Lamb classes
against torch, TiledLinear against nn.Linear, add_config_arguments, DeepSpeedConfig, log_dist, the refusals)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import shardspeed
from shardspeed.distributed import default_backend

TABLE = json.loads((Path(__file__).parents[1] / "compat" / "deepspeed_signatures.json").read_text())["names"]


def resolve(deepspeed_name: str) -> Any:
    """The shardspeed object for a DeepSpeed dotted name: the longest importable module, then attributes."""
    parts = ["shardspeed", *deepspeed_name.split(".")[1:]]
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise AssertionError(f"nothing importable for {deepspeed_name}")


def signature_problems(target: Any, expected: list[str]) -> list[str]:
    """Where ``target``'s signature cannot take a call written against DeepSpeed's parameter list ``expected``."""
    parameters = list(inspect.signature(target).parameters.values())
    if parameters and parameters[0].name == "self":  # a method looked up on its class
        parameters = parameters[1:]
    kinds = inspect.Parameter
    positional = [p.name for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in parameters}
    problems = []
    wanted = [name for name in expected if not name.startswith("*")]
    if positional[: len(wanted)] != wanted:
        problems.append(f"positional parameters {positional} do not start with DeepSpeed's {wanted}")
    if "**kwargs" in expected and not any(p.kind is kinds.VAR_KEYWORD for p in parameters):
        problems.append("no **kwargs (DeepSpeed forwards extra keywords)")
    for extra in (p for p in parameters if p.name not in wanted and p.kind in (kinds.POSITIONAL_OR_KEYWORD,)):
        if extra.default is inspect.Parameter.empty:
            problems.append(f"extra parameter {extra.name!r} has no default (DeepSpeed calls would miss it)")
    for name in wanted:
        if name in by_name and by_name[name].kind is kinds.POSITIONAL_ONLY:
            problems.append(f"{name!r} is positional-only; DeepSpeed callers pass it by keyword")
    return problems


@pytest.mark.parametrize("name", sorted(TABLE))
def test_deepspeed_name_exists_with_deepspeeds_parameters(name: str) -> None:
    target = resolve(name)
    expected = TABLE[name]
    if expected is not None:
        assert signature_problems(target, expected) == []


def test_signature_check_catches_mismatches() -> None:
    def swapped(b: int, a: int) -> None: ...

    def missing_default(a: int, extra: int) -> None: ...

    assert signature_problems(swapped, ["a", "b"])
    assert signature_problems(missing_default, ["a"])
    assert signature_problems(lambda a: None, ["a", "**kwargs"])
    assert signature_problems(lambda a, b=1, *, c=2: None, ["a"]) == []


# ---------------------------------------------------------------------------------------------- top level / args


def test_add_config_arguments_adds_deepspeeds_four_flags() -> None:
    parser = argparse.ArgumentParser()
    assert shardspeed.add_config_arguments(parser) is parser
    assert vars(parser.parse_args([])) == {
        "deepspeed": False,
        "deepspeed_config": None,
        "deepscale": False,
        "deepscale_config": None,
    }
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--deepscale", "--deepscale_config", "o"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (
        True,
        "ds.json",
        True,
        "o",
    )
    assert any(group.title == "DeepSpeed" for group in parser._action_groups)


def test_engine_alias_and_deepspeed_import_paths() -> None:
    from shardspeed.engine import ShardSpeedEngine
    from shardspeed.runtime.engine import DeepSpeedEngine

    assert shardspeed.DeepSpeedEngine is DeepSpeedEngine is ShardSpeedEngine
    assert shardspeed.runtime.utils.set_random_seed is resolve("deepspeed.runtime.utils.set_random_seed")
    assert shardspeed.zero.TiledLinear is resolve("deepspeed.runtime.zero.tiling.TiledLinear")
    assert shardspeed.utils.RepeatingLoader is shardspeed.RepeatingLoader
    assert shardspeed.version == shardspeed.__version__


def test_pipe_imports_like_deepspeed_pipe() -> None:
    from shardspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from shardspeed.pipe.module import PipelineModule as module_class

    assert shardspeed.PipelineModule is PipelineModule is module_class
    assert shardspeed.runtime.pipe.LayerSpec is LayerSpec
    assert shardspeed.pipe.TiedLayerSpec is TiedLayerSpec
    assert resolve("deepspeed.pipe.PipelineModule") is PipelineModule
    assert resolve("deepspeed.runtime.pipe.ProcessTopology") is shardspeed.pipe.ProcessTopology
    # Megatron-DeepSpeed's import paths reach the same module objects (one class identity)
    from shardspeed.runtime.pipe.module import PipelineModule as runtime_class
    from shardspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    assert runtime_class is PipelineModule
    assert PipeModelDataParallelTopology is shardspeed.pipe.topology.PipeModelDataParallelTopology
    assert importlib.import_module("shardspeed.runtime.pipe.topology") is shardspeed.pipe.topology


def test_moe_attribute_is_a_clear_import_error() -> None:
    with pytest.raises(ImportError, match=r"mixture of experts .* is not implemented yet"):
        _ = shardspeed.moe


# ---------------------------------------------------------------------------------------------- accelerator


def test_accelerator_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardspeed.accelerator import Accelerator, get_accelerator

    accelerator = get_accelerator()
    assert get_accelerator() is accelerator
    assert accelerator.communication_backend_name() == default_backend()
    if torch.cuda.is_available():
        pytest.skip("the CPU answers below are for a machine without CUDA")
    assert accelerator.device_name() == "cpu"
    assert accelerator.device_name(1) == "cpu"
    assert accelerator.current_device_name() == "cpu"
    assert accelerator.communication_backend_name() == "gloo"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert Accelerator().device_count() == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert Accelerator().device_count() == 1
    assert accelerator.is_bf16_supported() and accelerator.is_fp16_supported()
    assert accelerator.synchronize() is None
    assert accelerator.on_accelerator(torch.zeros(1))
    assert accelerator.memory_allocated() > 0
    assert accelerator.max_memory_allocated() >= accelerator.memory_allocated() > 0
    assert set(accelerator.memory_stats()) == {"allocated_bytes.all.current", "allocated_bytes.all.peak"}
    assert accelerator.total_memory() >= accelerator.available_memory() > 0
    tensor = accelerator.FloatTensor([1.0, 2.0])
    assert tensor.dtype == torch.float32 and tensor.tolist() == [1.0, 2.0]
    assert accelerator.IntTensor(2, 3).shape == (2, 3)
    with accelerator.stream(accelerator.current_stream()):
        pass
    with pytest.raises(NotImplementedError, match="no compiled op builders"):
        accelerator.get_op_builder("CPUAdamBuilder")


def test_accelerator_manual_seed_reproduces() -> None:
    from shardspeed.accelerator import get_accelerator

    get_accelerator().manual_seed(7)
    first = torch.rand(3)
    state = get_accelerator().get_rng_state()
    get_accelerator().manual_seed(7)
    assert torch.equal(torch.rand(3), first)
    get_accelerator().set_rng_state(state)


# ---------------------------------------------------------------------------------------------- comm


def test_comm_is_a_world_of_one_without_a_process_group() -> None:
    import shardspeed.comm as dist

    assert not dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (0, 1, 0)
    tensor = torch.tensor([2.0, 3.0])
    assert dist.all_reduce(tensor, op=dist.ReduceOp.SUM) is None
    assert tensor.tolist() == [2.0, 3.0]
    gathered = [torch.zeros(2)]
    dist.all_gather(gathered, tensor)
    assert gathered[0].tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match="2 entries but the world has 1 process"):
        dist.all_gather([torch.zeros(2), torch.zeros(2)], tensor)
    objects = [None]
    dist.all_gather_object(objects, {"a": 1})
    assert objects == [{"a": 1}]
    assert dist.barrier() is None
    assert dist.broadcast(tensor, src=0) is None


def _comm_on_ranks(rank: int, world_size: int) -> dict[str, Any]:
    import shardspeed.comm as dist

    summed = torch.tensor([float(rank + 1)])
    dist.all_reduce(summed)
    largest = torch.tensor([float(rank + 1)])
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    handle = dist.all_reduce(torch.ones(1), async_op=True)
    handle.wait()
    broadcast = torch.tensor([float(rank * 10)])
    dist.broadcast(broadcast, src=1)
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    scattered = torch.zeros(1)
    dist.reduce_scatter_tensor(scattered, torch.arange(world_size, dtype=torch.float32) + rank)
    objects: list[Any] = [None] * world_size
    dist.all_gather_object(objects, f"rank{rank}")
    dist.barrier()
    return {
        "initialized": dist.is_initialized(),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": dist.get_local_rank(),
        "sum": summed.item(),
        "max": largest.item(),
        "broadcast": broadcast.item(),
        "gathered": [t.item() for t in gathered],
        "scattered": scattered.item(),
        "objects": objects,
    }


def test_comm_functions_on_two_ranks(dist_run) -> None:
    results = dist_run(_comm_on_ranks, 2)
    for rank, result in enumerate(results):
        assert result == {
            "initialized": True,
            "rank": rank,
            "world_size": 2,
            "local_rank": rank,
            "sum": 3.0,
            "max": 2.0,
            "broadcast": 10.0,
            "gathered": [0.0, 1.0],
            "scattered": float(2 * rank + 1),  # element `rank` of (0+r0, 1+r0) + (0+r1, 1+r1)
            "objects": ["rank0", "rank1"],
        }


# ---------------------------------------------------------------------------------------------- utils / logging


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _log_dist_on_ranks(rank: int, world_size: int) -> list[str]:
    from shardspeed.utils import log_dist, logger

    capture = _Capture()
    logger.addHandler(capture)
    try:
        log_dist("to rank 1", ranks=[1])
        log_dist("to all", ranks=[-1], level=logging.WARNING)
        log_dist("to nobody")
    finally:
        logger.removeHandler(capture)
    return capture.messages


def test_log_dist_logs_on_the_chosen_ranks(dist_run) -> None:
    assert dist_run(_log_dist_on_ranks, 2) == [["[Rank 0] to all"], ["[Rank 1] to rank 1", "[Rank 1] to all"]]


def test_log_dist_without_a_group_logs_everything() -> None:
    from shardspeed.utils import log_dist, logger
    from shardspeed.utils.logging import should_log_le

    capture = _Capture()
    logger.addHandler(capture)
    try:
        log_dist("alone")
    finally:
        logger.removeHandler(capture)
    assert capture.messages == ["[Rank -1] alone"]
    assert logger is logging.getLogger("shardspeed")
    assert should_log_le("critical")
    with pytest.raises(ValueError, match="not one of the logging levels"):
        should_log_le("loud")


def test_set_random_seed_seeds_python_numpy_and_torch() -> None:
    from shardspeed.runtime.utils import set_random_seed

    def draw() -> tuple[Any, ...]:
        numpy = pytest.importorskip("numpy") if importlib.util.find_spec("numpy") else None
        return random.random(), torch.rand(2).tolist(), numpy.random.rand() if numpy else None

    set_random_seed(11)
    first = draw()
    set_random_seed(11)
    assert draw() == first


def test_runtime_utils_helpers() -> None:
    from shardspeed.runtime.utils import get_global_norm, move_to_device, partition_uniform

    # DeepSpeed's split points: the first num_items % num_parts parts are one larger
    assert partition_uniform(10, 3) == [0, 4, 7, 10]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    assert partition_uniform(6, 3) == [0, 2, 4, 6]
    assert get_global_norm([3.0, 4.0]) == 5.0
    tensor = torch.ones(2)
    moved = move_to_device({"a": [tensor, 1]}, "cpu", lambda item: isinstance(item, torch.Tensor))
    assert moved["a"][0] is tensor and moved["a"][1] == 1


# ---------------------------------------------------------------------------------------------- config


def test_deepspeed_config_reads_through_deepspeeds_names(tmp_path: Path) -> None:
    from shardspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    raw = {
        "train_batch_size": 16,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "gradient_clipping": 1.0,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    for source in (raw, str(path)):
        config = DeepSpeedConfig(source)
        assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (16, 4)
        assert config.gradient_accumulation_steps == 4
        assert (config.zero_optimization_stage, config.zero_enabled) == (2, True)
        assert (config.fp16_enabled, config.bf16_enabled, config.bfloat16_enabled) == (False, True, True)
        assert (config.optimizer_name, config.optimizer_params["lr"]) == ("Adam", 1e-3)
        assert config.gradient_clipping == 1.0
        assert config.world_size == 1
        assert config.config.zero_optimization.stage == 2
    with pytest.raises(AttributeError, match="read the typed config instead"):
        _ = config.sparse_attention
    with pytest.raises(DeepSpeedConfigError, match="train_batch_size"):
        DeepSpeedConfig({"train_batch_size": 0})

    class Mpu:
        def get_data_parallel_world_size(self) -> int:
            return 4

    assert DeepSpeedConfig({"train_batch_size": 16}, mpu=Mpu()).train_micro_batch_size_per_gpu == 4


# ---------------------------------------------------------------------------------------------- optimizers


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in ((5, 3), (7,))]


def _run(optimizer_factory, params: list[torch.nn.Parameter], steps: int = 4) -> list[torch.Tensor]:
    optimizer = optimizer_factory(params)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        optimizer.step()
    return [param.detach().clone() for param in params]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_adam_steps_like_torch_adamw_and_adam(weight_decay: float) -> None:
    from shardspeed.ops.adam import FusedAdam

    settings = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": weight_decay}
    ours = _run(lambda p: FusedAdam(p, **settings), _params())
    reference = _run(lambda p: torch.optim.AdamW(p, **settings), _params())
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    ours = _run(lambda p: FusedAdam(p, adam_w_mode=False, **settings), _params())
    reference = _run(lambda p: torch.optim.Adam(p, **settings), _params())
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_fused_adam_without_bias_correction_follows_the_formula() -> None:
    from shardspeed.ops.adam import FusedAdam

    params = _params()
    start = [param.detach().clone() for param in params]
    optimizer = FusedAdam(params, lr=0.1, bias_correction=False, betas=(0.9, 0.99), eps=1e-8)
    grads = [torch.full_like(param, 0.5) for param in params]
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer.step()
    for param, first, grad in zip(params, start, grads):  # m = 0.1 g, v = 0.01 g^2: step = 0.1 * 0.1g / (0.1|g|)
        expected = first - 0.1 * (0.1 * grad) / ((0.01 * grad * grad).sqrt() + 1e-8)
        torch.testing.assert_close(param.detach(), expected, atol=1e-6, rtol=0)
    assert set(optimizer.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_deepspeed_cpu_adam_steps_like_torch_adamw() -> None:
    from shardspeed.ops.adam import DeepSpeedCPUAdam

    settings = {"lr": 0.01, "weight_decay": 0.05}
    ours = _run(lambda p: DeepSpeedCPUAdam(p, **settings), _params())
    reference = _run(lambda p: torch.optim.AdamW(p, **settings), _params())
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    # bf16 parameters keep fp32 moments (fp32_optimizer_states) and follow the fp32 run to bf16 rounding
    params = _params(torch.bfloat16)
    optimizer = DeepSpeedCPUAdam(params, **settings)
    _ = _run(lambda p: optimizer, params, steps=1)
    assert optimizer.state[params[0]]["exp_avg"].dtype == torch.float32


def test_adam_classes_refuse_what_deepspeed_refuses() -> None:
    from shardspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from shardspeed.ops.lamb import FusedLamb

    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(_params(), amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DeepSpeedCPUAdam(_params(), amsgrad=True)
    with pytest.raises(RuntimeError, match="deprecated"):
        FusedAdam(_params()).step(scale=2.0)
    with pytest.raises(ValueError, match="gradient_clipping"):
        FusedLamb(_params(), max_grad_norm=1.0)
    optimizer = FusedAdam(_params())
    for param in optimizer.param_groups[0]["params"]:
        param.grad = torch.ones_like(param)
    optimizer.zero_grad()
    assert all(param.grad is None for param in optimizer.param_groups[0]["params"])  # set_grad_none=True


def test_fused_lamb_is_shardspeeds_lamb() -> None:
    from shardspeed.ops.lamb import FusedLamb
    from shardspeed.optim import Lamb

    settings = {"lr": 0.01, "weight_decay": 0.01, "max_coeff": 5.0, "min_coeff": 0.05}
    ours = _run(lambda p: FusedLamb(p, **settings), _params())
    reference = _run(lambda p: Lamb(p, **settings), _params())
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- TiledLinear


@pytest.mark.parametrize(("in_splits", "out_splits", "bias"), [(1, 1, True), (3, 2, True), (4, 3, False), (7, 1, True)])
def test_tiled_linear_equals_linear_forward_and_backward(in_splits: int, out_splits: int, bias: bool) -> None:
    from shardspeed.zero import TiledLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(10, 7, bias=bias)
    tiled = TiledLinear(10, 7, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=linear)
    assert sum(p.numel() for p in tiled.parameters()) == sum(p.numel() for p in linear.parameters())
    x = torch.randn(4, 3, 10, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = tiled(x), linear(x_ref)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    grad_out = torch.randn_like(ref)
    out.backward(grad_out)
    ref.backward(grad_out)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=0)
    for out_id in range(out_splits):
        rows = slice(tiled.out_parts[out_id], tiled.out_parts[out_id + 1])
        for in_id in range(in_splits):
            columns = slice(tiled.in_parts[in_id], tiled.in_parts[in_id + 1])
            tile = tiled.linears[out_id][in_id]
            torch.testing.assert_close(tile.weight.grad, linear.weight.grad[rows, columns], atol=1e-6, rtol=0)
            if tile.bias is not None:
                torch.testing.assert_close(tile.bias.grad, linear.bias.grad[rows], atol=1e-6, rtol=0)


def test_tiled_linear_split_input_and_uncombined_output() -> None:
    from shardspeed.runtime.zero.tiling import TiledLinear

    linear = torch.nn.Linear(6, 4)
    tiled = TiledLinear(6, 4, in_splits=2, out_splits=2, input_is_already_split=True, combine_out_splits=False)
    tiled.copy_params_from(linear)
    x = torch.randn(3, 6)
    pieces = tiled([x[:, :3], x[:, 3:]])
    assert [tuple(piece.shape) for piece in pieces] == [(3, 2), (3, 2)]
    torch.testing.assert_close(torch.cat(pieces, dim=-1), linear(x), atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="in_splits=7"):
        TiledLinear(6, 4, in_splits=7)
    with pytest.raises(ValueError, match="weight is"):
        TiledLinear(5, 4).copy_params_from(linear)


def test_deepspeed_memory_estimators_print_their_stage(capsys: pytest.CaptureFixture[str]) -> None:
    from shardspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    from shardspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    rows = estimate_zero3_model_states_mem_needs_all_live(torch.nn.Linear(100, 100), num_gpus_per_node=2)
    assert {row["stage"] for row in rows} == {3}
    plain = next(row for row in rows if not row["offload_optimizer"] and not row["offload_param"])
    assert plain["gpu_bytes"] == 10_100 * 16 // 2  # mixed-precision Adam: 16 bytes per parameter over 2 ranks
    rows = estimate_zero2_model_states_mem_needs_all_cold(1_000_000, num_nodes=2)
    assert {row["stage"] for row in rows} == {2}
    assert "offload_optimizer=cpu" in capsys.readouterr().out


def test_init_distributed_takes_deepspeeds_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    with pytest.raises(ValueError, match="pass rank and world_size together"):
        shardspeed.init_distributed(rank=0)
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    # auto_mpi_discovery=False ignores Open MPI's variables: a lone process, no group created
    launch = shardspeed.init_distributed(auto_mpi_discovery=False, distributed_port=1234, verbose=False)
    assert (launch.source, launch.rank, launch.world_size) == ("none", 0, 1)
    assert not dist.is_initialized()
    # dist_init_required=False: the caller owns initialization; Open MPI's layout is reported, nothing joined
    launch = shardspeed.init_distributed(dist_init_required=False)
    assert (launch.source, launch.rank, launch.world_size) == ("mpi", 1, 4)
    assert not dist.is_initialized()
