"""DeepSpeed's per-stage memory estimators on shardspeed's memory model (``zero/memory.py``).

``estimate_zero2_model_states_mem_needs_all_live(model, ...)`` / ``..._all_cold(total_params, ...)`` print the
stage-2 rows (with and without optimizer offload) of ``estimate_zero_memory``'s table, and the ``zero3`` variant
the stage-3 rows; the rows are also returned. Parameters are DeepSpeed's, ``additional_buffer_factor`` 1.5 as its
default. The figures are shardspeed's own model (mixed precision, paper accounting): model states per GPU, CPU
memory per node for offloaded states — the same table ``shardspeed estimate`` prints.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.zero.memory import estimate_zero_memory, format_table


def _stage_rows(stage: int, **arguments: Any) -> list[dict[str, Any]]:
    rows = [row for row in estimate_zero_memory(print_table=False, **arguments) if row["stage"] == stage]
    print(format_table(rows))
    return rows


def estimate_zero2_model_states_mem_needs_all_live(
    model: torch.nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[dict[str, Any]]:
    return _stage_rows(
        2, model=model, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes,
        additional_buffer_factor=additional_buffer_factor,
    )  # fmt: skip


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[dict[str, Any]]:
    return _stage_rows(
        2, num_params=int(total_params), num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes,
        additional_buffer_factor=additional_buffer_factor,
    )  # fmt: skip


def estimate_zero3_model_states_mem_needs_all_live(
    model: torch.nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[dict[str, Any]]:
    return _stage_rows(
        3, model=model, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes,
        additional_buffer_factor=additional_buffer_factor,
    )  # fmt: skip
