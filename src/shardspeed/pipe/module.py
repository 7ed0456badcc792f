"""``PipelineModule``: a sequence of layers split into pipeline stages (DeepSpeed's ``deepspeed.pipe``).

The forward pass is implicitly ``x = layer(x)`` over the layer list. Every rank keeps the whole list of specs,
computes the same partition from it (``partition.py``) and builds only its own layers: part ``c·p + s`` of the
``p·v`` parts is chunk ``c`` of pipe rank ``s``. Layers are registered under their *global* index (``"3.weight"``),
tied modules under ``"tied_modules.{key}."``, so parameter names — and checkpoints — do not depend on the stage
count. The executor calls ``module(inputs, chunk=c)`` so module hooks (ZeRO-3's) fire around each chunk.

[Note: seeded layers] ``seed_layers=True`` seeds the build of global layer ``i`` with ``base_seed + i`` (through
``seed_fn`` if given), so a layer's initial weights are the same whichever stage builds it and whatever the stage
count: a single-process reference built the same way matches. A tied module is built at its first occurrence on
each stage, seeded with ``base_seed + i`` of its *global* first occurrence (the owner's), so every stage's copy
starts equal even before the copies are overwritten from the owner (``sync_tied_weights``) — and where that sync
cannot run at construction (``zero.Init``'s meta parameters; the engine syncs after materializing them:
pipe/tied_sync.py). With ``seed_layers=False`` each stage builds with the RNG as it finds it; the engine's
initial broadcast (data rank 0) and the tied sync make replicas and copies agree.
Unlike DeepSpeed, forward does not reseed per layer and micro-batch: dropout draws from the running RNG (the
activation checkpoint's recompute replays it exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.checkpointing import checkpoint as default_checkpoint
from shardspeed.pipe.construct import agree_construction, check_arguments, resolve_topology
from shardspeed.pipe.partition import chunk_bounds, owner_of, partition_layers
from shardspeed.pipe.spec import LayerSpec, TiedLayerSpec, layer_class_name
from shardspeed.pipe.tied import TiedWeight, first_occurrences, tie_groups, tie_stages
from shardspeed.topology import Topology

__all__ = ["PipelineModule", "TiedWeight"]

Layer = Callable[[Any], Any]


class PipelineModule(nn.Module):
    """Layers partitioned over the pipe axis of ``topology`` (see the module docstring for the arguments' roles,
    and DeepSpeed's ``PipelineModule`` for their meaning; ``virtual_stages`` > 1 gives each rank several chunks
    for the interleaved schedule)."""

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = default_checkpoint,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
        *,
        virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        specs = list(layers)
        check_arguments(num_stages, topology, activation_checkpoint_interval, checkpointable_layers, virtual_stages)
        self.topology: Topology = resolve_topology(num_stages, topology)
        self.num_stages = self.topology.pipe.size
        self.stage_id = self.topology.pipe.rank
        self.virtual_stages = virtual_stages
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = list(checkpointable_layers) if checkpointable_layers is not None else None
        self.dynamic_shape = dynamic_shape
        self._layer_specs = specs
        self._num_layers = len(specs)
        self.parts: list[int] = partition_layers(specs, partition_method, self.num_stages, virtual_stages)
        self._local_start, self._local_stop = chunk_bounds(self.parts, self.num_stages, self.stage_id, 0)

        self.tied_modules = nn.ModuleDict()
        self._tied_attrs: dict[str, list[str]] = {}  # key → its tied parameters' names within the module
        self._chunks: list[list[_Entry]] = []
        stages = tie_stages(specs, self.parts, self.num_stages)  # pure: raises alike on every rank
        self._first_tied = first_occurrences(specs)
        failure: Exception | None = None
        try:
            self._chunks = [self._build_chunk(c) for c in range(virtual_stages)]
        except Exception as exc:  # agreed below: the other stages must not wait in new_group for this one
            failure = exc
        agree_construction(self.topology, (self.parts, stages), failure)
        axes = tie_groups(stages, self.topology)  # world-collective: every rank, same order
        self._tied: list[TiedWeight] = [
            TiedWeight(
                key=key,
                names=self._shared_names(key),
                stages=stages[key],
                owner=min(stages[key]),
                axis=axes[key],
            )
            for key in sorted(axes)
        ]
        self._sync_at_construction()

    # --- building ----------------------------------------------------------------------------------------------
    def _build_chunk(self, chunk: int) -> list[_Entry]:
        start, stop = chunk_bounds(self.parts, self.num_stages, self.stage_id, chunk)
        funcs: list[_Entry] = []
        for idx in range(start, stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:  # a tied module: its first occurrence's seed on every stage ([Note: seeded layers])
                self._seed(self.base_seed + self._first_tied.get(getattr(layer, "key", None), idx))
            if isinstance(layer, PipelineModule):
                raise TypeError(f"layer {idx} is a PipelineModule: nested pipeline modules are not supported")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key], self._tied_attrs[layer.key] = _checked_tied(layer, idx)
                funcs.append(_Entry(idx, f"tied_modules.{layer.key}", layer.forward_fn))
            elif isinstance(layer, LayerSpec):
                self.add_module(str(idx), layer.build())
                funcs.append(_Entry(idx, str(idx)))
            elif isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                funcs.append(_Entry(idx, str(idx)))
            elif callable(layer):
                funcs.append(_Entry(idx, None, None, layer))
            else:
                raise TypeError(f"layer {idx} is a {type(layer).__name__}: expected a LayerSpec, nn.Module or callable")
        return funcs

    def _seed(self, seed: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(seed)
        else:
            from shardspeed.runtime.utils import set_random_seed

            set_random_seed(seed)

    # --- forward -----------------------------------------------------------------------------------------------
    def forward(self, inputs: Any, chunk: int = 0) -> Any:
        """This rank's layers of local chunk ``chunk`` applied to ``inputs`` (a tensor or a tuple of tensors; each
        layer gets the previous output as its one argument), checkpointing every ``activation_checkpoint_interval``
        layers ([Note: checkpointed ranges])."""
        if not 0 <= chunk < self.virtual_stages:
            raise ValueError(f"chunk {chunk} out of range: this module has {self.virtual_stages} chunk(s) per rank")
        # Modules are looked up by name on every call: a module replaced after construction (AutoTP swapping a
        # layer, a wrapper) is the one that runs.
        funcs = [self._resolve(entry) for entry in self._chunks[chunk]]
        if not funcs:
            raise RuntimeError(f"pipe rank {self.stage_id} holds no layers in chunk {chunk} (parts {self.parts})")
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return _run(funcs, inputs)
        x = inputs
        for start in range(0, len(funcs), interval):
            piece = funcs[start : start + interval]
            args = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(piece):
                x = self.activation_checkpoint_func(partial(_run_unpacked, piece), *args)
            else:
                x = _run_unpacked(piece, *args)
        return x

    def _resolve(self, entry: _Entry) -> tuple[Layer, Any]:
        """(what forward calls, what it is matched by) for one layer entry."""
        if entry.path is None:
            assert entry.func is not None
            return entry.func, entry.func
        module = self.get_submodule(entry.path)
        return (module if entry.forward_fn is None else partial(entry.forward_fn, module)), module

    def _is_checkpointable(self, piece: list[tuple[Layer, Any]]) -> bool:
        """[Note: checkpointed ranges] A range of ``activation_checkpoint_interval`` layers is recomputed in backward
        when every layer's class is in ``checkpointable_layers`` (when given), else when any layer has parameters
        (a range of parameter-free functions is cheaper to keep than to recompute), as DeepSpeed."""
        if self.checkpointable_layers is not None:
            return all(layer_class_name(what) in self.checkpointable_layers for _, what in piece)
        return any(isinstance(what, nn.Module) and any(True for _ in what.parameters()) for _, what in piece)

    # --- tied weights ------------------------------------------------------------------------------------------
    def tied_weights(self) -> list[TiedWeight]:
        """The tied keys this rank holds, sorted by key ([Note: tied weights across stages])."""
        return list(self._tied)

    def tied_copy_names(self) -> frozenset[str]:
        """Parameter names here that copy a weight another stage owns (``params.TiedCopyProvider``): every
        parameter of a tied module whose owner is another stage — the whole module is shared ([Note: the whole
        tied module is shared]), as DeepSpeed marks it ``ds_pipe_replicated``; the owner's are the model's
        (counted in the norm, written to checkpoints)."""
        return frozenset(
            f"tied_modules.{tie.key}.{name}"
            for tie in self._tied
            if tie.owner != self.stage_id
            for name, _ in self.tied_modules[tie.key].named_parameters()
        )

    def synced_names(self, tie: TiedWeight) -> list[str]:
        """What the sync broadcasts for ``tie``: every parameter of its module (the frozen ones too: copies start
        equal), in the module's order — the same on every stage of the tie."""
        return [f"tied_modules.{tie.key}.{n}" for n, _ in self.tied_modules[tie.key].named_parameters()]

    def _shared_names(self, key: str) -> tuple[str, ...]:
        """[Note: the whole tied module is shared] Every trainable parameter of a tied module is one model weight
        across its stages, not only ``tied_weight_attr`` (which is still checked, and listed first): the copies of a
        bias or a scale that a stage's ``forward_fn`` reads are counted and checkpointed once (the owner's), like
        the tied weight, so they must also get the summed gradient and stay equal. (DeepSpeed all-reduces only
        ``tied_weight_attr`` and lets the others train apart on each stage while saving the owner's.) A parameter
        one stage never uses gets a zero gradient there: the sum is the other stage's gradient, as intended."""
        attrs = self._tied_attrs[key]
        rest = [n for n, p in self.tied_modules[key].named_parameters() if p.requires_grad and n not in attrs]
        return tuple(f"tied_modules.{key}.{n}" for n in [*attrs, *rest])

    def sync_tied_weights(self, collectives: Any) -> None:
        """Broadcast each tied module's parameters from its owner stage over its tie group (collective over the
        tie groups). Parameters without storage (built under ``zero.Init``: synced after materialization,
        pipe/tied_sync.py) are skipped — alike on every stage of a tie, which are built the same way."""
        for tie in self._tied:
            if tie.axis.group is None:
                continue
            for name in self.synced_names(tie):
                param = self.get_parameter(name)
                if param.is_meta or param.numel() == 0:
                    continue
                with torch.no_grad():
                    staged = _staged_for(param.data, tie.axis.group)
                    collectives.broadcast(staged, tie.axis, 0, tag=f"pipe.tied.{tie.key}")
                    if staged is not param.data:
                        param.data.copy_(staged)

    def _sync_at_construction(self) -> None:
        """Copies equal from the start, as DeepSpeed's constructor makes them (the engine syncs again through its
        logged collectives, after any change a script made in between)."""
        if any(tie.axis.group is not None for tie in self._tied):
            from shardspeed.comm.collectives import Collectives

            self.sync_tied_weights(Collectives())

    # --- DeepSpeed's accessors ---------------------------------------------------------------------------------
    def partitions(self) -> list[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        """Pipe rank holding global layer ``layer_idx``."""
        return owner_of(layer_idx, self.parts, self.num_stages)[0]

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def mpu(self) -> Topology:
        """The topology as a Megatron-style mpu (DeepSpeed returns its grid here)."""
        return self.topology

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"activation checkpoint interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval

    def chunk_layers(self, chunk: int = 0) -> list[int]:
        """Global indices of the layers in local chunk ``chunk``."""
        return [entry.index for entry in self._chunks[chunk]]


def _checked_tied(spec: TiedLayerSpec, idx: int) -> tuple[nn.Module, list[str]]:
    """The key's module, built, and the parameter names of its ``tied_weight_attr``: each attribute is a dotted
    path (DeepSpeed resolves it with getattr, so a property returning a parameter works: Megatron-DeepSpeed's
    ``word_embeddings_weight``) that must reach one of the module's parameters; its name is the parameter's own."""
    module = spec.build()
    by_id = {id(p): name for name, p in module.named_parameters()}
    names: list[str] = []
    for attr in spec.tied_weight_attr:
        target: Any = module
        for part in attr.split("."):
            target = getattr(target, part, None)
        if not isinstance(target, nn.Parameter) or id(target) not in by_id:
            raise ValueError(
                f"tied key '{spec.key}' (layer {idx}, {spec.typename.__name__}): tied_weight_attr '{attr}' reaches "
                f"no parameter of the module (its parameters: {sorted(by_id.values())})"
            )
        names.append(by_id[id(target)])
    return module, names


@dataclass(frozen=True)
class _Entry:
    """One layer of a chunk: its global index and where forward finds it — a registered module's path (with the
    tied occurrence's ``forward_fn``), or a plain callable kept as is."""

    index: int
    path: str | None
    forward_fn: Callable[[nn.Module, Any], Any] | None = None
    func: Layer | None = None


def _run(funcs: list[tuple[Layer, Any]], x: Any) -> Any:
    for func, _ in funcs:
        x = func(x)
    return x


def _run_unpacked(funcs: list[tuple[Layer, Any]], *inputs: Any) -> Any:
    """A checkpointed range takes the tuple's members as arguments; a single one is passed on unwrapped."""
    return _run(funcs, inputs[0] if len(inputs) == 1 else inputs)


def _staged_for(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` on a device the group's backend can broadcast (NCCL needs CUDA memory)."""
    if tensor.device.type == "cpu" and dist.get_backend(group) == "nccl":
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor
