"""What ``eval_batch`` returns, DeepSpeed's semantics (``PipelineEngine._reduce_outputs`` / ``_bcast_pipe_scalar``).

On the last stage the per-micro-batch values are the losses (``compute_loss``) or the model outputs; with
``reduce_output="avg"`` they are summed over micro-batches, divided by their count, and averaged over the data axis;
with None they stay a list. With ``compute_loss`` and ``bcast_loss`` the loss goes to every stage of the pipeline
(a list of losses as one stacked tensor); otherwise the other stages return None.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.comm import Collectives
from shardspeed.pipe.executor import ExecResult
from shardspeed.topology import Topology

__all__ = ["reduce_eval_outputs"]


def _average(values: list[Any], m: int, topology: Topology, collectives: Collectives) -> Any:
    if isinstance(values[0], torch.Tensor):
        total = torch.stack([v.float() for v in values]).sum(0) / m
        if topology.data.size > 1:
            collectives.all_reduce(total, topology.data, tag="pipe.eval")
            total /= topology.data.size
        return total
    return type(values[0])(_average([v[i] for v in values], m, topology, collectives) for i in range(len(values[0])))


def reduce_eval_outputs(
    result: ExecResult,
    *,
    compute_loss: bool,
    reduce_output: str | None,
    bcast_loss: bool,
    micro_batches: int,
    topology: Topology,
    collectives: Collectives,
    device: torch.device,
) -> Any:
    last = topology.pipe.size - 1
    value: Any = None
    if topology.pipe.rank == last:
        values: list[Any] = list(result.losses if compute_loss else result.outputs)
        value = values if reduce_output is None else _average(values, micro_batches, topology, collectives)
    if not (compute_loss and bcast_loss):
        return value
    # The loss to every stage: a scalar (avg) or the m per-micro-batch losses (reduce_output=None).
    shape = (micro_batches,) if reduce_output is None else ()
    if topology.pipe.rank == last:
        out = (torch.stack([v.float() for v in value]) if reduce_output is None else value.float()).to(device)
        out = out.reshape(shape).contiguous()
    else:
        out = torch.zeros(shape, dtype=torch.float32, device=device)
    collectives.broadcast(out, topology.pipe, src_index=last, tag="pipe.eval_loss")
    return out
