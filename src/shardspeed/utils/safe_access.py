"""DeepSpeed's ``deepspeed.utils`` parameter accessors: ``safe_get_full_fp32_param``, ``safe_get_full_grad``,
``safe_get_full_optimizer_state`` and their ``safe_set_*`` / ``safe_get_local_*`` / ``safe_set_local_*`` forms.

They work at every ZeRO stage (DeepSpeed: stages 1-3 and its bf16 optimizer; ``None`` elsewhere), with mixed
precision (values are the fp32 masters) and offload, all through the stage's checkpoint pieces
([Note: parameter access through pieces] in param_access.py). A parameter finds its engine through ``OWNERS``, a
weak identity map the engine fills at construction (nothing is written on the ``nn.Parameter``).

Collectives, as in DeepSpeed: at stages 1-3 the ``safe_get_full_*`` functions all-reduce over the data-parallel
group and ``safe_set_full_fp32_param`` / ``safe_set_local_fp32_param`` propagate the new values (all-gather / copy
back), so every rank must call them for the same parameter. At stage 0 (and for parameters a stage keeps whole)
reads are local. ``safe_set_full_grad``, ``safe_set_*optimizer_state`` and the other local forms never communicate.

When they are valid: gradients only between the backward that completes an accumulation window (it reduced them)
and ``step()``, which consumes and zeroes them; optimizer states once the optimizer has stepped (before that there
are none: KeyError). Gradients are returned unscaled (fp16's loss scale divided out) and averaged over the
data-parallel ranks, i.e. the gradient ``step()`` will apply before clipping. With ZeRO-3 gradients on NVMe they are
read from and written back to the swap file ([Note: gradients on NVMe] in zero/stage3/grad_offload.py).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from shardspeed.param_access import assemble, local_pieces, piece_slice, write_values
from shardspeed.zero.stage3.registry import WeakIdMap

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
]

OWNERS: WeakIdMap[tuple[weakref.ref[Any], str]] = WeakIdMap()
"""nn.Parameter → (its engine, its canonical name). Filled by ``register_engine_parameters``."""


def register_engine_parameters(engine: Any) -> None:
    """Record every parameter of ``engine.module`` (the engine calls this once it is built)."""
    ref = weakref.ref(engine)
    for name, p in engine.module.named_parameters():
        OWNERS.set(p, (ref, name))


def engines_of(params: Any) -> list[Any]:
    """The live engines owning any of ``params`` (each once)."""
    found: dict[int, Any] = {}
    for p in params:
        entry = OWNERS.get(p)
        engine = entry[0]() if entry is not None else None
        if engine is not None:
            found.setdefault(id(engine), engine)
    return list(found.values())


def _owner(param: torch.Tensor) -> tuple[Any, str]:
    entry = OWNERS.get(param)
    engine = entry[0]() if entry is not None else None
    if entry is None or engine is None:
        raise ValueError(
            f"parameter of shape {tuple(param.shape)} belongs to no live shardspeed engine: pass a parameter of the "
            "model given to shardspeed.initialize()"
        )
    engine.states.wait_params()  # [Note: overlapped parameter gather] in zero/param_gather.py
    return engine, entry[1]


def _grad_scale(engine: Any) -> float:
    """What the stored gradients are multiplied by: fp16's current loss scale (the step divides it out)."""
    return engine.loss_scaler.scale if engine.loss_scaler is not None else 1.0


def _require_reduced_grads(engine: Any, name: str) -> None:
    if not engine.states.reducer.reduced:
        raise RuntimeError(
            f"gradient of '{name}' read or written outside its valid window: gradients are complete only between "
            "the backward that ends a gradient-accumulation window and step() (which applies and zeroes them)"
        )


def _state_of(engine: Any, piece: Any, key: str) -> torch.Tensor | None:
    if engine.optimizer is None or piece.opt_tensor is None:
        return None
    value = engine.optimizer.state.get(piece.opt_tensor, {}).get(key)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.shape != piece.opt_tensor.shape:
        raise ValueError(f"optimizer state '{key}' is one value per tensor, not per element; read optimizer.state")
    return piece_slice(value, piece)


def _refuse_streamed_state_write(engine: Any) -> None:
    if hasattr(engine.optimizer, "after_checkpoint_load"):
        raise NotImplementedError(
            "safe_set_*_optimizer_state with an offloaded optimizer (offload_optimizer): its states live in its "
            "store; set them through a checkpoint (save_checkpoint / load_checkpoint) instead"
        )


# --- full (collective at stages 1-3) -----------------------------------------------------------------------------
def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """The whole fp32 value of ``param`` (the master under mixed precision). Every rank must call it."""
    engine, name = _owner(param)
    return assemble(engine, name, lambda piece: piece.value, "the fp32 value")


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``value`` (the whole tensor, the same on every rank) ``param``'s fp32 value and its training-dtype value.
    Every rank must call it."""
    engine, name = _owner(param)
    _check_shape(engine, name, value)
    write_values(engine, {name: value})


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor:
    """The whole reduced fp32 gradient of ``param`` (see the module docstring for when it exists). Every rank must
    call it."""
    engine, name = _owner(param)
    _require_reduced_grads(engine, name)
    scale = _grad_scale(engine)

    def read(piece: Any) -> torch.Tensor | None:
        grad = _grad_of(engine, piece)
        return piece_slice(grad, piece) / scale if grad is not None else None

    return assemble(engine, name, read, "the gradient")


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace ``param``'s reduced gradient by ``value`` (whole; each rank keeps its part). Between the boundary
    backward and ``step()``."""
    engine, name = _owner(param)
    _require_reduced_grads(engine, name)
    _check_shape(engine, name, value)
    scale, flat = _grad_scale(engine), value.detach().reshape(-1)
    with torch.no_grad():
        for piece in local_pieces(engine, name):
            if _grad_of(engine, piece) is None:
                raise ValueError(f"parameter '{name}' has no gradient (frozen?)")
            _write_grad(engine, piece, flat[piece.start : piece.end] * scale)
    engine.states.mark_grads_clean()  # the engine's own write, not a user's zero_grad ([Note: gradient markers])


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor:
    """The whole fp32 optimizer state ``optim_state_key`` (e.g. Adam's ``exp_avg``) of ``param``. Every rank must
    call it."""
    engine, name = _owner(param)
    return assemble(
        engine, name, lambda piece: _state_of(engine, piece, optim_state_key), f"optimizer state '{optim_state_key}'"
    )


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Replace optimizer state ``optim_state_key`` of ``param`` by ``value`` (whole; each rank keeps its part)."""
    engine, name = _owner(param)
    _check_shape(engine, name, value)
    flat = value.detach().reshape(-1)
    _write_state(engine, name, optim_state_key, lambda piece: flat[piece.start : piece.end])


# --- local (this rank's partition) --------------------------------------------------------------------------------
def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """This rank's partition of ``param``'s fp32 value, flattened (stage 0: the whole parameter)."""
    engine, name = _owner(param)
    return _local(engine, name, lambda piece: piece.value)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's partition of ``param``'s reduced fp32 gradient, flattened and unscaled."""
    engine, name = _owner(param)
    _require_reduced_grads(engine, name)
    scale = _grad_scale(engine)
    return _local(engine, name, lambda piece: piece_slice(_grad_of(engine, piece), piece) / scale)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor:
    """This rank's partition of optimizer state ``optim_state_key`` of ``param``, flattened."""
    engine, name = _owner(param)

    def read(piece: Any) -> torch.Tensor:
        state = _state_of(engine, piece, optim_state_key)
        if state is None:
            raise KeyError(f"optimizer state '{optim_state_key}' of parameter '{name}' does not exist (yet)")
        return state

    return _local(engine, name, read)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's partition of ``param``'s fp32 value (flattened, as ``safe_get_local_fp32_param`` returns
    it). Unlike DeepSpeed this also updates the training-dtype parameter, so it is collective: every rank calls it."""
    engine, name = _owner(param)
    pieces = local_pieces(engine, name)
    flat = _check_local(name, pieces, value)
    from shardspeed.checkpoint.engine_io import _resident

    offset = 0
    with torch.no_grad():
        for piece in _resident(engine, pieces, writing=True):
            piece.value.copy_(flat[offset : offset + piece.numel])
            offset += piece.numel
        after_load = getattr(engine.optimizer, "after_checkpoint_load", None)
        if after_load is not None:
            after_load()
        engine.states.after_optimizer_step()


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's partition of ``param``'s reduced gradient (flattened, unscaled)."""
    engine, name = _owner(param)
    _require_reduced_grads(engine, name)
    pieces = local_pieces(engine, name)
    flat, offset, scale = _check_local(name, pieces, value), 0, _grad_scale(engine)
    with torch.no_grad():
        for piece in pieces:
            _write_grad(engine, piece, flat[offset : offset + piece.numel] * scale)
            offset += piece.numel
    engine.states.mark_grads_clean()  # the engine's own write, not a user's zero_grad ([Note: gradient markers])


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Replace this rank's partition of optimizer state ``optim_state_key`` of ``param`` (flattened)."""
    engine, name = _owner(param)
    pieces = local_pieces(engine, name)
    flat = _check_local(name, pieces, value)
    starts, offset = {}, 0
    for piece in pieces:
        starts[piece.start] = offset
        offset += piece.numel
    _write_state(
        engine, name, optim_state_key, lambda piece: flat[starts[piece.start] : starts[piece.start] + piece.numel]
    )


# --- helpers ------------------------------------------------------------------------------------------------------
def _grad_of(engine: Any, piece: Any) -> torch.Tensor | None:
    """The gradient of ``piece``'s stepped tensor. ZeRO-3 with gradients on NVMe keeps it in the swap file (the
    ``.grad`` is a zeros stand-in): read it back ([Note: gradients on NVMe] in zero/stage3/grad_offload.py)."""
    tensor = piece.opt_tensor
    if tensor is None:
        return None
    sink = getattr(engine.states, "grad_sink", None)
    stored = sink.read_tensor(tensor) if sink is not None else None
    return stored.to(tensor.device) if stored is not None else tensor.grad


def _write_grad(engine: Any, piece: Any, values: torch.Tensor) -> None:
    """Write ``values`` (scaled) over ``piece``'s range of its stepped tensor's gradient (in the swap file if there)."""
    sink = getattr(engine.states, "grad_sink", None)
    if sink is not None and sink.holds(piece.opt_tensor):
        sink.write_tensor(piece.opt_tensor, piece.opt_offset, values.detach().float().cpu())
        return
    piece_slice(piece.opt_tensor.grad, piece).copy_(values)


def _check_shape(engine: Any, name: str, value: torch.Tensor) -> None:
    from shardspeed.param_access import full_shapes

    shape = full_shapes(engine.module)[name]
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"value for parameter '{name}' has shape {tuple(value.shape)}; the parameter is {tuple(shape)}"
        )


def _check_local(name: str, pieces: list[Any], value: torch.Tensor) -> torch.Tensor:
    numel = sum(p.numel for p in pieces)
    if value.numel() != numel:
        raise ValueError(f"local value for parameter '{name}' has {value.numel()} elements; this rank holds {numel}")
    return value.detach().reshape(-1)


def _local(engine: Any, name: str, read: Any) -> torch.Tensor:
    from shardspeed.checkpoint.engine_io import _resident

    parts = [read(piece).detach().float().clone() for piece in _resident(engine, local_pieces(engine, name), False)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=engine.device)


def _write_state(engine: Any, name: str, key: str, source: Any) -> None:
    if engine.optimizer is None:
        raise ValueError("this engine has no optimizer")
    _refuse_streamed_state_write(engine)
    with torch.no_grad():
        for piece in local_pieces(engine, name):
            target = _state_of(engine, piece, key)
            if target is None:
                raise KeyError(f"optimizer state '{key}' of parameter '{name}' does not exist (yet)")
            target.copy_(source(piece))
