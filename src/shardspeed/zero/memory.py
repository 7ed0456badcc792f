"""How many bytes of model states (parameters, gradients, optimizer states) each data-parallel rank holds.

Pure arithmetic on parameter counts — no tensors, no process groups, and torch is only imported to count a
model's parameters — so ``shardspeed estimate`` answers instantly and the numbers are testable exactly.

[Note: two accountings] The ZeRO paper (arXiv 1910.02054, section 3.1) counts mixed-precision Adam as fp16
parameters 2Ψ + fp16 gradients 2Ψ + K·Ψ optimizer states (fp32 master 4 + momentum 4 + variance 4: K = 12) and
divides whatever a stage shards by the N data-parallel ranks. shardspeed's engine differs in one place: for
bf16/fp16 training it accumulates gradients in fp32 (low-precision gradients exist only transiently inside
backward), so its gradient buffer costs 4 B per element, not 2. ``accounting="paper"`` reproduces the paper's
table; ``accounting="shardspeed"`` is what the engine really allocates. fp32 training is the same under both:
params 4Ψ, grads 4Ψ, Adam 8Ψ (no separate master copy). ``precision="bf16"`` is bf16 master weights and
optimizer states (``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``; [Note: low-precision masters] in
config/precision.py): params 2Ψ, grads 2Ψ, Adam 4Ψ (momentum 2 + variance 2), again no separate master copy and
the same under both accountings (DeepSpeed's example README counts a separate bf16 master, 2Ψ more).

[Note: padding] Gradients and optimizer states live in flat buffers whose buckets are padded to a multiple of N
(see ``layout.py``), so those are counted over ``padded_numel`` elements; the module's own (unsharded)
parameter tensors are not padded and count ``num_params``. Sharded quantities count ``ceil(padded_numel / N)``.

[Note: offload] Semantics follow DeepSpeed's estimators (``estimate_zero2/3_model_states_mem_needs``):
``offload_optimizer`` moves the optimizer states (fp32 master included) *and* the gradient partition the CPU
optimizer consumes to CPU memory, kept in fp32 there. With stages 2-3 the GPU then holds no gradient partition
(reduced buckets stream to the host); stage 1 still all-reduces full gradients on the GPU, so those stay.
``offload_param`` (stage 3) moves the parameter shards to CPU as well. Unlike DeepSpeed we count steady-state
model states only: not the fp32 copy of the model each process may build at start-up, nor ZeRO-3's working
buffer for the largest layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.config.errors import did_you_mean

PRECISIONS: tuple[str, ...] = ("mixed", "fp32", "bf16")
ACCOUNTINGS: tuple[str, ...] = ("paper", "shardspeed")
STAGES: tuple[int, ...] = (0, 1, 2, 3)

MIXED_ADAM_STATE_BYTES = 12  # K of the paper: fp32 master 4 + momentum 4 + variance 4
FP32_ADAM_STATE_BYTES = 8  # momentum 4 + variance 4; the fp32 parameters are their own master copy
BF16_ADAM_STATE_BYTES = 4  # bf16 momentum 2 + variance 2; the bf16 parameters are their own master copy
CPU_GRAD_BYTES = 4  # a CPU optimizer steps on fp32 gradients, whatever the training precision

GB = 10**9  # the paper's unit (120 GB for 7.5B parameters at stage 0)

# Offload combinations listed per stage, as DeepSpeed's estimators list them: (offload_optimizer, offload_param).
OFFLOAD_VARIANTS: dict[int, tuple[tuple[bool, bool], ...]] = {
    0: ((False, False),),
    1: ((False, False), (True, False)),
    2: ((False, False), (True, False)),
    3: ((False, False), (True, False), (True, True)),
}


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of each model state before sharding: the assumption set an estimate rests on."""

    params: int
    grads: int
    optimizer: int
    precision: str
    accounting: str

    def describe(self) -> str:
        """One line naming the assumptions, printed above every table so a figure is never read without them."""
        if self.precision == "mixed":
            head = "mixed precision Adam"
            grads = "fp32 gradient accumulation" if self.grads == 4 else "fp16/bf16 gradients"
            states = "fp32 master 4 + momentum 4 + variance 4" if self.optimizer == 12 else "incl. fp32 master 4"
        elif self.precision == "bf16":
            head, grads = "bf16 master weights Adam", "bf16 gradients"
            states = "bf16 momentum 2 + variance 2" if self.optimizer == 4 else "no separate master copy"
        else:
            head, grads = "fp32 Adam", "fp32 gradients"
            states = "momentum 4 + variance 4" if self.optimizer == 8 else "no separate master copy"
        note = "as shardspeed's engine allocates" if self.accounting == "shardspeed" else "as in the ZeRO paper"
        return (
            f"{head}: {self.params} B params + {self.grads} B grads + {self.optimizer} B optimizer states per "
            f"parameter ({self.accounting} accounting, {note}; {grads}; optimizer states: {states})"
        )


def _check_choice(argument: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{argument}={value!r} is not one of {list(valid)}{did_you_mean(str(value), valid)}")


def _check_count(argument: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{argument}={value!r} must be an integer >= {minimum}")


def bytes_per_param(
    precision: str = "mixed", accounting: str = "paper", optimizer_state_bytes_per_param: int | None = None
) -> BytesPerParam:
    """The per-parameter byte counts for ``precision`` x ``accounting`` (see [Note: two accountings]).

    ``optimizer_state_bytes_per_param`` is the paper's K (master copy included for mixed precision); default 12
    for mixed-precision Adam, 8 for fp32 Adam and 4 for bf16 master weights with bf16 Adam states.
    """
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("accounting", accounting, ACCOUNTINGS)
    if optimizer_state_bytes_per_param is None:
        optimizer = {"mixed": MIXED_ADAM_STATE_BYTES, "fp32": FP32_ADAM_STATE_BYTES}.get(
            precision, BF16_ADAM_STATE_BYTES
        )
    else:
        _check_count("optimizer_state_bytes_per_param", optimizer_state_bytes_per_param, 0)
        optimizer = optimizer_state_bytes_per_param
    if precision == "fp32":
        return BytesPerParam(4, 4, optimizer, precision, accounting)
    if precision == "bf16":
        return BytesPerParam(2, 2, optimizer, precision, accounting)
    grads = 4 if accounting == "shardspeed" else 2
    return BytesPerParam(2, grads, optimizer, precision, accounting)


@dataclass(frozen=True)
class ModelStateBytes:
    """Model-state bytes one rank holds: on its accelerator (params, grads, optimizer) and in CPU memory."""

    params: int
    grads: int
    optimizer: int  # fp32 master copy (mixed precision) + optimizer states
    cpu: int = 0  # offloaded states attributable to this rank

    def total(self) -> int:
        """Bytes on the accelerator; ``cpu`` is reported separately because it is a different memory."""
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    num_params: int,
    world: int,
    stage: int,
    *,
    precision: str = "mixed",
    accounting: str = "paper",
    optimizer_state_bytes_per_param: int | None = None,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    padded_numel: int | None = None,
) -> ModelStateBytes:
    """Model-state bytes per rank for ZeRO ``stage`` with ``world`` data-parallel ranks.

    ``padded_numel`` is the padded flat-buffer size the engine really uses (default ``num_params``); see
    [Note: padding]. Offload semantics: [Note: offload].
    """
    _check_count("num_params", num_params, 0)
    _check_count("world", world, 1)
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; valid stages are {list(STAGES)}")
    if padded_numel is None:
        padded_numel = num_params
    _check_count("padded_numel", padded_numel, num_params)
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer=True needs ZeRO stage 1, 2 or 3 (stage 0 has no optimizer partition)")
    if offload_param and stage != 3:
        raise ValueError(f"offload_param=True needs ZeRO stage 3 (parameters are only partitioned there); got {stage}")
    if precision == "bf16" and (offload_optimizer or offload_param):
        raise ValueError('precision="bf16" (bf16 master weights) cannot be combined with offload in shardspeed')
    per_param = bytes_per_param(precision, accounting, optimizer_state_bytes_per_param)

    shard = -(-padded_numel // world)  # ceil: a partial last shard still occupies a full slot
    params = per_param.params * (shard if stage >= 3 else num_params)
    grads = per_param.grads * (shard if stage >= 2 else padded_numel)
    optimizer = per_param.optimizer * (shard if stage >= 1 else padded_numel)
    cpu = 0
    if offload_optimizer:
        cpu += optimizer + CPU_GRAD_BYTES * shard
        optimizer = 0
        if stage >= 2:
            grads = 0
    if offload_param:
        cpu += params
        params = 0
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer, cpu=cpu)


def count_trainable_params(model: torch.nn.Module) -> int:
    """Elements of ``model``'s trainable parameters, each shared (tied) parameter once, frozen ones excluded.

    Tied weights are usually one Parameter object (``parameters()`` yields it once); two Parameter objects that
    view the same memory are deduplicated by address too. Meta-device parameters all report address 0, so they
    are deduplicated by identity only — which lets huge models be estimated without allocating them.
    """
    seen: set[object] = set()
    total = 0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        key: object = id(param) if param.is_meta or param.numel() == 0 else (param.data_ptr(), param.numel())
        if key in seen:
            continue
        seen.add(key)
        total += param.numel()
    return total


def estimate_zero_memory(
    model: torch.nn.Module | None = None,
    *,
    num_params: int | None = None,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    precision: str = "mixed",
    accounting: str = "paper",
    additional_buffer_factor: float = 1.0,
    optimizer_state_bytes_per_param: int | None = None,
    padded_numel: int | None = None,
    print_table: bool = True,
) -> list[dict[str, Any]]:
    """Model-state memory per GPU (and offloaded CPU memory per node) for every ZeRO stage and offload variant.

    Give either ``model`` (its trainable parameters are counted) or ``num_params``. N = ``num_gpus_per_node`` x
    ``num_nodes`` data-parallel ranks. ``additional_buffer_factor`` scales the CPU figure only, as in DeepSpeed's
    estimators (headroom for pinned staging buffers). Prints ``format_table(rows)`` unless ``print_table`` is
    false. Each row: stage, offload_optimizer, offload_param, options, params_bytes, grads_bytes,
    optimizer_bytes, gpu_bytes (per GPU), cpu_bytes_per_gpu, cpu_bytes_per_node, plus the setup it was
    computed for (num_params, num_gpus_per_node, num_nodes, world, assumptions).
    """
    if (model is None) == (num_params is None):
        raise ValueError("estimate_zero_memory needs exactly one of model= or num_params=")
    if model is not None:
        num_params = count_trainable_params(model)
    assert num_params is not None
    _check_count("num_gpus_per_node", num_gpus_per_node, 1)
    _check_count("num_nodes", num_nodes, 1)
    if not additional_buffer_factor >= 1.0:  # also rejects NaN
        raise ValueError(f"additional_buffer_factor={additional_buffer_factor!r} must be >= 1.0")
    world = num_gpus_per_node * num_nodes
    assumptions = bytes_per_param(precision, accounting, optimizer_state_bytes_per_param).describe()

    rows: list[dict[str, Any]] = []
    for stage, variants in OFFLOAD_VARIANTS.items():
        for offload_optimizer, offload_param in variants:
            if precision == "bf16" and (offload_optimizer or offload_param):
                continue  # bf16 master weights refuse offload (config/root.py)
            states = model_state_bytes(
                num_params,
                world,
                stage,
                precision=precision,
                accounting=accounting,
                optimizer_state_bytes_per_param=optimizer_state_bytes_per_param,
                offload_optimizer=offload_optimizer,
                offload_param=offload_param,
                padded_numel=padded_numel,
            )
            rows.append(
                {
                    "stage": stage,
                    "offload_optimizer": offload_optimizer,
                    "offload_param": offload_param,
                    "options": _options_text(offload_optimizer, offload_param),
                    "params_bytes": states.params,
                    "grads_bytes": states.grads,
                    "optimizer_bytes": states.optimizer,
                    "gpu_bytes": states.total(),
                    "cpu_bytes_per_gpu": states.cpu,
                    "cpu_bytes_per_node": round(states.cpu * num_gpus_per_node * additional_buffer_factor),
                    "num_params": num_params,
                    "num_gpus_per_node": num_gpus_per_node,
                    "num_nodes": num_nodes,
                    "world": world,
                    "assumptions": assumptions,
                }
            )
    if print_table:
        print(format_table(rows))
    return rows


def _options_text(offload_optimizer: bool, offload_param: bool) -> str:
    optimizer_device = "cpu" if offload_optimizer else "none"
    param_device = "cpu" if offload_param else "none"
    return f"offload_optimizer={optimizer_device}, offload_param={param_device}"


def _gb(num_bytes: int) -> str:
    """One decimal like the paper (120.0, 1.9); three significant digits below 1 GB so small shards stay visible."""
    value = num_bytes / GB
    if value == 0 or value >= 1:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _count_text(num_params: int) -> str:
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if num_params >= scale:
            return f"{num_params / scale:.2f}{suffix} ({num_params:,})"
    return f"{num_params:,}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows of ``estimate_zero_memory`` as a text table, headed by the setup and the byte assumptions."""
    if not rows:
        return "(no rows)"
    first = rows[0]
    nodes, gpus = first["num_nodes"], first["num_gpus_per_node"]
    header = ("stage", "GB per GPU", "params", "grads", "optimizer", "CPU GB per node", "options")
    body = [
        (
            str(row["stage"]),
            _gb(row["gpu_bytes"]),
            _gb(row["params_bytes"]),
            _gb(row["grads_bytes"]),
            _gb(row["optimizer_bytes"]),
            _gb(row["cpu_bytes_per_node"]),
            str(row["options"]),
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]

    def render(line: tuple[str, ...]) -> str:
        cells = [cell.rjust(width) for cell, width in zip(line[:-1], widths)]
        return " | ".join([*cells, line[-1]]).rstrip()

    lines = [
        "Estimated memory for model states (parameters, gradients, optimizer states):",
        f"HW: {nodes} node(s) x {gpus} GPU(s) per node = {first['world']} data-parallel ranks (N)",
        f"SW: {_count_text(first['num_params'])} trainable parameters",
        f"Assumptions: {first['assumptions']}",
        "GB = 1e9 bytes. Not included: activations, communication buckets, temporary buffers, allocator overhead.",
        "",
        render(header),
        "-+-".join("-" * width for width in widths),
        *(render(line) for line in body),
    ]
    return "\n".join(lines)


def allocated_model_states(module: torch.nn.Module, states: Any, optimizer: Any) -> dict[str, int]:
    """What ``engine.memory_breakdown()`` reports: bytes really allocated per role (see its docstring)."""
    out = {"params": _unique_storage_bytes(module.parameters())}
    for role, tensors in states.buffers().items():
        if role != "params":
            tensors = tensors if isinstance(tensors, list) else [tensors]
            out[role] = sum(t.numel() * t.element_size() for t in tensors)
    opt_state = optimizer.state.values() if optimizer is not None else ()
    tensors = [t for s in opt_state for t in s.values() if isinstance(t, torch.Tensor)]
    # a streamed (offloaded) optimizer's state lives in its store; what it keeps on the device it reports
    out["optimizer_states"] = _unique_storage_bytes(tensors) + getattr(optimizer, "resident_state_bytes", 0)
    compression = getattr(states, "compression", None)  # 1-bit Adam under ZeRO-1/2: worker error buffers
    if compression is not None:
        out["compression_errors"] = compression.error_bytes  # built at the first compressed step: +4Ψ then
    out["peak_bucket_bytes"] = states.peak_bucket_bytes
    return out


def _unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one flat buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
