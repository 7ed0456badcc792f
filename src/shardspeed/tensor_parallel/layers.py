"""Column- and row-parallel linear layers (Megatron-LM's ``ColumnParallelLinear`` / ``RowParallelLinear``).

A transformer MLP is ``Y = act(X A) B``. Split ``A`` by columns (each rank computes its slice of ``act(X A)``,
no communication: the activation is elementwise) and ``B`` by rows (each rank's partial product is summed): one
all-reduce in forward (``g`` after B) and one in backward (``f`` before A). Attention splits the same way by heads.

Weights are stored as ``nn.Linear`` stores them (``[out, in]``) unless ``weight_layout="in_out"`` (Hugging Face's
``Conv1D``, GPT-2: ``[in, out]``), so a sliced model's state-dict keys and orientation match the original's and
``save_pretrained`` output stays loadable by the unsliced model. Each layer declares its parameters' specs
(``tensor_parallel_specs``: [Note: parameter specs] in params/spec.py): the global shape, the split dim, and for
fused projections (``parts``, e.g. QKV = 3) that each part is split separately.

Sequence parallelism (``tp.sequence_parallel``): the column-parallel layer's input arrives split along the sequence
dim and is all-gathered (``f̄``); the row-parallel layer's output is reduce-scattered along it (``ḡ``), and its
bias, added after the reduce-scatter on a sequence shard, gets a partial gradient (``partial_grad``). The gathered
input is saved by autograd for the weight gradient as the gathered tensor (simpler; Megatron instead saves the
shard and re-gathers it in backward to save activation memory — stated in docs/architecture.md).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.params.spec import ParamSpec, shard_bounds
from shardspeed.tensor_parallel.context import TensorParallel
from shardspeed.tensor_parallel.mappings import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tensor_region,
)

WeightLayout = Literal["out_in", "in_out"]


def _local_size(dim: int, parts: int, tp: TensorParallel) -> int:
    block = dim // parts
    start, end = shard_bounds(block, tp.size, tp.rank)
    return (end - start) * parts


class _ParallelLinear(nn.Module):
    """What the two layers share: storage in either layout, specs, slicing a dense weight."""

    split_weight_dim_out_in: int  # the weight dim split, in the [out, in] layout
    split_bias: bool

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallel,
        *,
        bias: bool,
        parts: int,
        weight_layout: WeightLayout,
        sequence_dim: int,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        if weight_layout not in ("out_in", "in_out"):
            raise ValueError(
                f"weight_layout must be 'out_in' (nn.Linear) or 'in_out' (HF Conv1D), got {weight_layout!r}"
            )
        split_features = out_features if self.split_weight_dim_out_in == 0 else in_features
        if split_features % parts:
            raise ValueError(f"{type(self).__name__}: {split_features} features cannot hold {parts} fused parts")
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.parts = parts
        self.weight_layout = weight_layout
        self.sequence_dim = sequence_dim
        global_out_in = (out_features, in_features)
        self.global_weight_shape = global_out_in if weight_layout == "out_in" else global_out_in[::-1]
        self.weight_spec = ParamSpec(
            self.global_weight_shape,
            partition_dim=self.split_weight_dim_out_in
            if weight_layout == "out_in"
            else 1 - self.split_weight_dim_out_in,
            parts=parts,
        )
        kwargs = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(self.weight_spec.local_shape(tp.rank, tp.size), **kwargs))
        if bias:
            bias_features = out_features
            self.bias_spec = (
                ParamSpec((bias_features,), partition_dim=0, parts=parts)
                if self.split_bias
                else ParamSpec((bias_features,), partial_grad=tp.sequence_parallel and tp.size > 1)
            )
            self.bias = nn.Parameter(torch.empty(self.bias_spec.local_shape(tp.rank, tp.size), **kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, drawn for the global weight and sliced, so a sliced model starts from the
        same values as the dense one built after the same seed (on every rank alike)."""
        full = torch.empty(self.global_weight_shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(full if self.weight_layout == "out_in" else full.T, a=math.sqrt(5))
        with torch.no_grad():
            self.weight.copy_(self.weight_spec.slice_global(full, self.tp.rank, self.tp.size))
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                full_bias = torch.empty(self.out_features).uniform_(-bound, bound)
                self.bias.copy_(self.bias_spec.slice_global(full_bias, self.tp.rank, self.tp.size))

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]:
        specs = {"weight": self.weight_spec}
        if self.bias is not None:
            specs["bias"] = self.bias_spec
        return specs

    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy this rank's slice of a dense (global) ``weight`` / ``bias`` in."""
        with torch.no_grad():
            self.weight.copy_(self.weight_spec.slice_global(weight.detach(), self.tp.rank, self.tp.size))
            if (bias is None) != (self.bias is None):
                raise ValueError(f"{type(self).__name__}.load_dense: bias given/absent does not match the layer")
            if bias is not None:
                self.bias.copy_(self.bias_spec.slice_global(bias.detach(), self.tp.rank, self.tp.size))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight_layout == "out_in" else self.weight.T
        return F.linear(x, weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp.size}, "
            f"parts={self.parts}, layout={self.weight_layout}, bias={self.bias is not None}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X A`` with ``A`` split by output features: this rank computes ``Y``'s slice ``[:, rank's columns]``.

    Input: replicated (or sequence-split under sequence parallelism, gathered here). Output: split along the last
    dim unless ``gather_output`` (then all-gathered; used before a non-parallel consumer such as an LM head's loss
    that needs full logits). ``parts``: a fused projection (QKV = 3) whose parts are split separately, so each rank
    holds whole heads of q, of k and of v.
    """

    split_weight_dim_out_in = 0
    split_bias = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallel,
        *,
        bias: bool = True,
        gather_output: bool = False,
        parts: int = 1,
        weight_layout: WeightLayout = "out_in",
        sequence_dim: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.gather_output = gather_output
        super().__init__(
            in_features,
            out_features,
            tp,
            bias=bias,
            parts=parts,
            weight_layout=weight_layout,
            sequence_dim=sequence_dim,
            dtype=dtype,
            device=device,
        )
        if gather_output and parts > 1:
            raise ValueError("ColumnParallelLinear: gather_output with fused parts would interleave the parts")

    @property
    def local_out_features(self) -> int:
        return _local_size(self.out_features, self.parts, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_parallel:
            x = gather_from_sequence_region(x, self.tp, self.sequence_dim)  # f̄
        else:
            x = copy_to_tensor_region(x, self.tp)  # f
        y = self._matmul(x)
        if self.bias is not None:
            y = y + self.bias
        return gather_from_tensor_region(y, self.tp, self.out_features) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """``Y = X B`` with ``B`` split by input features: each rank multiplies its slice of ``X``'s last dim and the
    partial products are summed (``g``; under sequence parallelism reduce-scattered along the sequence, ``ḡ``).

    Input: split along the last dim (``input_is_parallel``, the output of a column-parallel layer) or replicated
    (then this rank's slice is taken). The bias is replicated and added once, after the sum.
    """

    split_weight_dim_out_in = 1
    split_bias = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallel,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        parts: int = 1,
        weight_layout: WeightLayout = "out_in",
        sequence_dim: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.input_is_parallel = input_is_parallel
        super().__init__(
            in_features,
            out_features,
            tp,
            bias=bias,
            parts=parts,
            weight_layout=weight_layout,
            sequence_dim=sequence_dim,
            dtype=dtype,
            device=device,
        )
        if tp.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence parallelism needs input_is_parallel=True")
        if parts > 1 and not input_is_parallel:
            raise ValueError("RowParallelLinear: input_is_parallel=False with fused parts would split across parts")

    @property
    def local_in_features(self) -> int:
        return _local_size(self.in_features, self.parts, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.tp)
        partial = self._matmul(x)
        if self.tp.sequence_parallel:
            y = reduce_scatter_to_sequence_region(partial, self.tp, self.sequence_dim)  # ḡ
        else:
            y = reduce_from_tensor_region(partial, self.tp)  # g
        return y + self.bias if self.bias is not None else y
