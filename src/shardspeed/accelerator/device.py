"""``get_accelerator()``: DeepSpeed's accelerator interface for the one device kind a process trains on.

DeepSpeed has one class per vendor (CUDA, CPU, XPU, NPU, ...). shardspeed runs on torch's CUDA and CPU backends
only, so one class answers for both, deciding at construction: CUDA when ``torch.cuda.is_available()``, else
CPU. Method names and parameters are DeepSpeed's (``DeepSpeedAccelerator`` in its ``abstract_accelerator.py``).

CPU answers, where DeepSpeed's CPU accelerator differs: ``communication_backend_name()`` is ``"gloo"`` (the
backend ``init_distributed`` uses; DeepSpeed's CPU build says ``"ccl"``, which needs Intel's oneCCL bindings);
``device_count()`` is the launcher's processes per node (``LOCAL_WORLD_SIZE``) or 1 (DeepSpeed counts NUMA
nodes); ``is_fp16_supported()`` is True (the engine's fp16 loss scaling runs on CPU). Memory figures on CPU are
the process's resident set size, as in DeepSpeed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

from shardspeed.distributed import default_backend


def _rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {key}")


class Accelerator:
    """DeepSpeed's accelerator methods over torch.cuda (when available) or the CPU."""

    def __init__(self, name: str | None = None) -> None:
        if name is None:
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name not in ("cuda", "cpu"):
            raise ValueError(f"accelerator {name!r}: shardspeed supports 'cuda' and 'cpu'")
        if name == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("accelerator 'cuda' requested but torch.cuda.is_available() is False")
        self._name = name
        self._communication_backend_name = "nccl" if name == "cuda" else default_backend()
        self._peak_rss = _rss_bytes() if name == "cpu" else 0

    @property
    def _cuda(self) -> bool:
        return self._name == "cuda"

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    # ---- properties of the device kind
    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def use_host_timers(self) -> bool:
        return not self._cuda

    def resolves_data_dependency(self) -> bool:
        return not self._cuda

    def handles_memory_backpressure(self) -> bool:
        return not self._cuda

    # ---- devices
    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or not self._cuda:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        if self._cuda:
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    # ---- random number generators
    def random(self) -> Any:
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self, seed: int | None = None) -> int:
        """The current initial seed (``seed`` is accepted for DeepSpeed's abstract signature and unused)."""
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # ---- streams and events (CPU: none; stream() is a no-op context, as in DeepSpeed's CPU accelerator)
    @property
    def Stream(self) -> Any:
        return torch.cuda.Stream if self._cuda else None

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    @property
    def Event(self) -> Any:
        return torch.cuda.Event if self._cuda else None

    # ---- memory (CPU: the process's resident set size, peak tracked between resets)
    def _rss(self) -> int:
        current = _rss_bytes()
        self._peak_rss = max(self._peak_rss, current)
        return current

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        current = self._rss()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self._peak_rss}

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = _rss_bytes()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        self._rss()
        return self._peak_rss

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return _meminfo_bytes("MemAvailable")

    # ---- data types
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float, torch.half]
        return [*dtypes, torch.bfloat16] if self.is_bf16_supported() else dtypes

    # ---- misc
    def amp(self) -> Any:
        return torch.cuda.amp if self._cuda else torch.cpu.amp

    def is_available(self) -> bool:
        return True

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        return False

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._cuda else []

    # ---- graphs (CUDA only)
    def create_graph(self) -> Any:
        self._require_cuda("CUDA graphs")
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        self._require_cuda("CUDA graphs")
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    # ---- tensors
    @property
    def BFloat16Tensor(self) -> Any:
        return self._tensor_type(torch.bfloat16)

    @property
    def ByteTensor(self) -> Any:
        return self._tensor_type(torch.uint8)

    @property
    def DoubleTensor(self) -> Any:
        return self._tensor_type(torch.float64)

    @property
    def FloatTensor(self) -> Any:
        return self._tensor_type(torch.float32)

    @property
    def HalfTensor(self) -> Any:
        return self._tensor_type(torch.float16)

    @property
    def IntTensor(self) -> Any:
        return self._tensor_type(torch.int32)

    @property
    def LongTensor(self) -> Any:
        return self._tensor_type(torch.int64)

    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        """A constructor like ``torch.cuda.FloatTensor([...])``, without torch's deprecated typed-tensor classes."""
        device = self.current_device_name()

        def build(*data: Any) -> torch.Tensor:
            if data and all(isinstance(size, int) for size in data):  # FloatTensor(3, 4): a shape
                return torch.empty(*data, dtype=dtype, device=device)
            (values,) = data  # FloatTensor([0.0]): the values
            return torch.tensor(values, dtype=dtype, device=device)

        return build

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ---- compiled ops: shardspeed has none (pure Python on torch)
    def op_builder_dir(self) -> str:
        raise NotImplementedError(_NO_OP_BUILDERS)

    def create_op_builder(self, class_name: str) -> Any:
        raise NotImplementedError(_NO_OP_BUILDERS)

    def get_op_builder(self, class_name: str) -> Any:
        raise NotImplementedError(_NO_OP_BUILDERS)

    def build_extension(self) -> Any:
        raise NotImplementedError(_NO_OP_BUILDERS)

    def _require_cuda(self, what: str) -> None:
        if not self._cuda:
            raise NotImplementedError(f"{what} need CUDA; this accelerator is {self._name!r}")


_NO_OP_BUILDERS = (
    "shardspeed has no compiled op builders (it is pure Python on torch); use shardspeed.ops.adam.FusedAdam, "
    "DeepSpeedCPUAdam or shardspeed.ops.lamb.FusedLamb, which need no build"
)

DeepSpeedAccelerator = Accelerator
"""DeepSpeed's name for the accelerator interface (``isinstance`` checks and ``set_accelerator`` use it)."""

_current: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's accelerator, created on first use (CUDA when available, else CPU)."""
    global _current
    if _current is None:
        _current = Accelerator()
    return _current


def set_accelerator(accel_obj: Accelerator) -> None:
    """Replace the process's accelerator (DeepSpeed's hook for out-of-tree accelerators)."""
    global _current
    if not isinstance(accel_obj, Accelerator):
        raise TypeError(f"set_accelerator: expected an Accelerator, got {type(accel_obj).__name__}")
    _current = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in ("cuda", "cpu")
