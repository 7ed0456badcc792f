"""``TiledLinear`` (DeepSpeed's ``deepspeed.runtime.zero.tiling``): one ``nn.Linear`` as in_splits × out_splits tiles.

Each tile is its own ``nn.Linear`` (its own parameters), so under ZeRO-3 a huge layer is gathered one tile at a
time instead of whole. The math is ``nn.Linear``'s: the input's last dimension is cut at ``in_parts``, tile
``(o, i)`` maps input piece ``i`` to output piece ``o``, the ``in_splits`` partial products of an output piece are
summed (only the last input tile of a row carries the bias, so it is added once), and the output pieces are
concatenated. Split points follow DeepSpeed's ``partition_uniform``: sizes differ by at most one, larger first.

``copy_params_from(linear)`` loads a plain ``nn.Linear``'s weight and bias into the tiles (under ZeRO-3 through
``GatheredParameters``, modified on rank 0), so a tiled layer can start as an exact copy of an untiled one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardspeed.runtime.utils import partition_uniform


def split_tensor_along_last_dim(
    tensor: torch.Tensor, partitions: Sequence[int], contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """``tensor`` cut along its last dimension into pieces of the sizes in ``partitions``."""
    pieces = torch.split(tensor, list(partitions), dim=tensor.dim() - 1)
    return tuple(piece.contiguous() for piece in pieces) if contiguous_split_chunks else pieces


class TiledLinear(torch.nn.Module):
    """A drop-in for ``nn.Linear(in_features, out_features, bias)`` built from in_splits × out_splits tiles."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: type[torch.nn.Module] = torch.nn.Linear,
        init_linear: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(f"TiledLinear: in_splits={in_splits} must be in [1, in_features={in_features}]")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(f"TiledLinear: out_splits={out_splits} must be in [1, out_features={out_features}]")
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = partition_uniform(num_items=in_features, num_parts=in_splits)
        self.out_parts = partition_uniform(num_items=out_features, num_parts=out_splits)
        # linears[o][i] maps input piece i to output piece o; the bias sits on the last input tile of each row.
        self.linears = torch.nn.ModuleList()
        for out_id in range(out_splits):
            row = torch.nn.ModuleList()
            rows = self.out_parts[out_id + 1] - self.out_parts[out_id]
            for in_id in range(in_splits):
                columns = self.in_parts[in_id + 1] - self.in_parts[in_id]
                row.append(linear_cls(columns, rows, bias=bias and in_id == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def _in_sizes(self) -> list[int]:
        return [self.in_parts[p + 1] - self.in_parts[p] for p in range(self.in_splits)]

    def forward(self, input_: Any) -> Any:
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: got {len(inputs)} input pieces, expected in_splits={self.in_splits}")
        else:
            inputs = list(self._split_global_input(input_, self._in_sizes()))
        outputs = []
        for out_id in range(self.out_splits):
            reduced = None
            for in_id in range(self.in_splits):
                local = self.linears[out_id][in_id](inputs[in_id])
                reduced = self._reduce_local_output(in_id=in_id, out_id=out_id, current_out=reduced, new_out=local)
            outputs.append(reduced)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input: torch.Tensor, split_sizes: list[int]) -> Sequence[torch.Tensor]:
        """Cut the input's last dimension at the input tiles' boundaries (subclasses: other input types)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Sum the partial products of one output piece (subclasses: other output types)."""
        return new_out if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """Concatenate the output pieces along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Load ``other``'s (an ``nn.Linear`` of the full size) weight and bias into the tiles."""
        from shardspeed.zero import GatheredParameters

        weight, bias = other.weight, getattr(other, "bias", None)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"TiledLinear.copy_params_from: weight is {tuple(weight.shape)}, expected "
                f"{(self.out_features, self.in_features)}"
            )
        if self.use_bias != (bias is not None):
            raise ValueError(
                f"TiledLinear.copy_params_from: bias={self.use_bias} but the source has bias={bias is not None}"
            )
        for out_id in range(self.out_splits):
            row_start, row_stop = self.out_parts[out_id], self.out_parts[out_id + 1]
            for in_id in range(self.in_splits):
                col_start, col_stop = self.in_parts[in_id], self.in_parts[in_id + 1]
                tile = self.linears[out_id][in_id]
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(weight[row_start:row_stop, col_start:col_stop])
                if tile.bias is not None:
                    with GatheredParameters(tile.bias, modifier_rank=0):
                        tile.bias.copy_(bias[row_start:row_stop])


class TiledLinearReturnBias(TiledLinear):
    """For linear classes whose forward returns ``(output, bias)`` (Megatron-style): outputs are summed and
    concatenated as above, the returned biases (only the last input tile's) are concatenated separately."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        tensor, bias = new_out
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        summed = super()._reduce_local_output(in_id=in_id, out_id=out_id, current_out=old_tensor, new_out=tensor)
        return summed, bias if bias is not None else old_bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensor = super()._combine_output_splits([output[0] for output in outputs])
        biases = [output[1] for output in outputs if output[1] is not None]
        return tensor, (super()._combine_output_splits(biases) if biases else None)


__all__ = ["TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim"]
