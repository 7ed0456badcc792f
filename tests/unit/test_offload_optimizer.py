"""StreamedAdam (offloaded Adam/AdamW) against torch's optimizers, its checkpoint-facing state, and the config
sections it reads (``offload_optimizer``, ``aio``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardspeed.config import ConfigError, load_config
from shardspeed.config.offload import OffloadOptimizerConfig
from shardspeed.offload import AioSettings, TensorSwapper
from shardspeed.offload.optimizer import HostStore, StreamedAdam
from shardspeed.offload.wrap import offload_optimizer

SMALL_AIO = AioSettings(block_size=4096, queue_depth=4, thread_count=2)


def _offload(device: str, **keys: object) -> OffloadOptimizerConfig:
    return OffloadOptimizerConfig(device=device, **keys)


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in (50, 7, 130)]


def _grads(step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(t.numel(), generator=g) for t in like]


def _groups(tensors: list[torch.Tensor]) -> list[dict]:
    return [{"params": tensors[:2], "weight_decay": 0.1}, {"params": tensors[2:], "lr": 0.002, "weight_decay": 0.0}]


def _run(cls: type, wrap: str, tmp_path: Path, steps: int = 4) -> tuple[list[torch.Tensor], object]:
    """Train copies of the same tensors with ``cls`` (torch), optionally streamed through a store."""
    tensors = _tensors()
    inner = cls(_groups(tensors), lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    optimizer: object = inner
    if wrap == "host":
        optimizer = StreamedAdam(inner, HostStore(pin_memory=True), chunk_numel=16)
    elif wrap == "nvme":
        swapper = TensorSwapper(tmp_path, StreamedAdam.bytes_needed(inner, 16, SMALL_AIO), SMALL_AIO)
        optimizer = StreamedAdam(inner, swapper, chunk_numel=16)
    for step in range(steps):
        for t, grad in zip(tensors, _grads(step, tensors)):
            t.grad = grad
        if step == 2:
            optimizer.param_groups[0]["lr"] = 0.02  # what an LR scheduler does between steps
        optimizer.step()
    return tensors, optimizer


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("wrap", ["host", "nvme"])
def test_streamed_adam_matches_torch(tmp_path: Path, cls: type, wrap: str) -> None:
    expected, _ = _run(cls, "none", tmp_path)
    got, optimizer = _run(cls, wrap, tmp_path)
    start = _tensors()
    assert max((e - s).abs().max().item() for e, s in zip(expected, start)) > 1e-2
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=0)
    optimizer.close()  # type: ignore[attr-defined]
    assert list(tmp_path.iterdir()) == []  # the nvme store's job directory is gone


def test_state_reads_back_in_torch_layout(tmp_path: Path) -> None:
    reference, torch_opt = _run(torch.optim.AdamW, "none", tmp_path)
    tensors, streamed = _run(torch.optim.AdamW, "nvme", tmp_path)
    for t, r in zip(tensors, reference):
        ours, theirs = streamed.state.get(t), torch_opt.state[r]  # type: ignore[attr-defined]
        assert float(ours["step"]) == float(theirs["step"]) == 4
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours[key], theirs[key].view(-1), atol=1e-6, rtol=0)
    assert streamed.state.get(torch.zeros(3), {}) == {}  # type: ignore[attr-defined]
    streamed.close()  # type: ignore[attr-defined]


def test_loaded_state_is_written_back_to_the_store(tmp_path: Path) -> None:
    tensors, streamed = _run(torch.optim.AdamW, "nvme", tmp_path, steps=1)
    entry = streamed.state[tensors[0]]  # type: ignore[attr-defined]
    entry["exp_avg"].fill_(0.5)
    entry["step"] = torch.tensor(9.0)
    tensors[0].fill_(2.0)  # a loaded parameter value
    streamed.after_checkpoint_load()  # type: ignore[attr-defined]
    again = streamed.state.get(tensors[0])  # type: ignore[attr-defined]
    assert float(again["step"]) == 9 and torch.equal(again["exp_avg"], torch.full((50,), 0.5))
    # expectation: torch AdamW continuing from exactly the loaded state (value 2.0, exp_avg 0.5, step 9)
    ref = torch.full((50,), 2.0, requires_grad=True)
    ref_opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ref_opt.state[ref] = {k: v.clone() for k, v in again.items()}
    grad = torch.randn(50, generator=torch.Generator().manual_seed(5))
    ref.grad = grad.clone()
    ref_opt.step()
    tensors[0].grad = grad.clone()
    for t in tensors[1:]:
        t.grad = torch.zeros_like(t)
    streamed.step()  # type: ignore[attr-defined]
    torch.testing.assert_close(tensors[0], ref.detach(), atol=1e-6, rtol=0)
    streamed.close()  # type: ignore[attr-defined]


def test_only_adam_and_adamw_can_be_offloaded(tmp_path: Path) -> None:
    sgd = torch.optim.SGD([torch.zeros(4, requires_grad=True)], lr=0.1)
    with pytest.raises(ConfigError, match="needs Adam or AdamW, got SGD"):
        StreamedAdam(sgd, HostStore(False), 8)
    amsgrad = torch.optim.Adam([torch.zeros(4, requires_grad=True)], amsgrad=True)
    with pytest.raises(ConfigError, match="amsgrad"):
        StreamedAdam(amsgrad, HostStore(False), 8)


def test_cpu_offload_without_accelerator_keeps_the_optimizer(tmp_path: Path) -> None:
    inner = torch.optim.AdamW([torch.zeros(4, requires_grad=True)])
    out = offload_optimizer(inner, _offload("cpu"), settings=SMALL_AIO, chunk_numel=8, rank=0, agree=lambda o: [o])
    assert out is inner


def test_unusable_nvme_path_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.touch()
    inner = torch.optim.AdamW([torch.zeros(4, requires_grad=True)])
    with pytest.raises(RuntimeError, match=r"nvme_path = '.*file/swap' is unusable on data-parallel rank 0"):
        offload_optimizer(
            inner,
            _offload("nvme", nvme_path=str(blocker / "swap")),
            settings=SMALL_AIO,
            chunk_numel=8,
            rank=0,
            agree=lambda o: [o],
        )


# ------------------------------------------------------------------------------------------------ config


def _config(zero: dict, **extra: object):
    return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, **extra}, dp_world_size=1)


def test_aio_section_is_typed_and_builds_swapper_settings() -> None:
    cfg = _config({"stage": 1}, aio={"block_size": 8192, "queue_depth": 2, "thread_count": 3, "overlap_events": False})
    assert cfg.warnings == []  # no longer an ignored key
    assert cfg.aio.settings() == AioSettings(block_size=8192, queue_depth=2, thread_count=3, overlap_events=False)
    # shardspeed's defaults: DeepSpeed's, except 4 MiB requests from 2 threads (see config/aio.py)
    assert _config({"stage": 1}).aio.settings() == AioSettings(block_size=4 << 20, thread_count=2)


def test_aio_bad_key_and_value_are_named() -> None:
    with pytest.raises(ConfigError, match=r'"aio\.queue_dept"'):
        _config({"stage": 1}, aio={"queue_dept": 4})
    with pytest.raises(ConfigError, match=r"aio\.thread_count"):
        _config({"stage": 1}, aio={"thread_count": 0})


def test_offload_optimizer_config_rules() -> None:
    assert _config({"stage": 2, "offload_optimizer": {"device": "cpu"}}).zero_optimization.offload_optimizer
    nvme = {"device": "nvme", "nvme_path": "/tmp/x"}
    assert _config({"stage": 3, "offload_optimizer": nvme}).zero_optimization.offload_optimizer.nvme_path == "/tmp/x"
    with pytest.raises(ConfigError, match='needs "nvme_path"'):
        _config({"stage": 1, "offload_optimizer": {"device": "nvme"}})
    with pytest.raises(ConfigError, match="needs ZeRO stage 1, 2 or 3"):
        _config({"stage": 0, "offload_optimizer": {"device": "cpu"}})
