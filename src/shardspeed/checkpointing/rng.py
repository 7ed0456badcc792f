"""Random-number state for checkpointed regions: the named-state tracker and whole-RNG snapshots.

Two separate needs:

1. Tensor parallelism wants two RNG streams. Dropout on *replicated* activations must draw the same mask on
   every tensor-axis rank (they hold the same numbers, and must keep holding the same numbers); dropout on
   *partitioned* activations (each rank holds a different slice) should draw independent masks, or the slices
   would all be dropped in the same pattern. ``RNGStatesTracker`` keeps named generator states; inside
   ``tracker.fork()`` the device generator runs on the named state (seeded differently per tensor rank),
   outside it runs on the default state (seeded identically). DeepSpeed and Megatron call this the "CUDA RNG
   tracker"; here it tracks whatever device the accelerator is — the CPU generator on a CPU-only machine.

2. Recompute must replay exactly the random numbers the forward drew. ``RngSnapshot`` captures the CPU
   generator, the accelerator generators and every tracked state at the start of a checkpointed forward, and
   ``restored()`` replays from it during the recompute — then puts the *current* states back, so the recompute
   does not advance any stream and a run with checkpointing draws the same numbers as one without.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The tracker state that tensor-parallel regions fork into (DeepSpeed's and Megatron's name)."""

MODEL_PARALLEL_SEED_OFFSET = 2718
"""``model_parallel_cuda_manual_seed(seed)`` seeds the tensor-parallel stream with ``seed + 2718 + tensor rank``
(DeepSpeed's and Megatron's offset, kept so seeds mean the same thing in both), and the default stream with
``seed`` itself."""


def accelerator_device() -> torch.device:
    """The device the tracker drives: the current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state on ``device`` (a CPU byte tensor, as torch returns it)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    raise ValueError(f"RNG state of device {device}: only cpu and cuda devices are supported")


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    elif device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        raise ValueError(f"RNG state of device {device}: only cpu and cuda devices are supported")


def manual_seed(device: torch.device, seed: int) -> None:
    """Seed only ``device``'s default generator (``torch.manual_seed`` would reseed every device)."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    elif device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    else:
        raise ValueError(f"seeding device {device}: only cpu and cuda devices are supported")


class RNGStatesTracker:
    """Named generator states for one device, swapped in with ``fork(name)``.

    DeepSpeed's ``CudaRNGStatesTracker`` API (``reset``, ``get_states``, ``set_states``, ``add``, ``fork``), but
    bound to an explicit device so it works on CPU-only machines as well.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self._fixed_device = device
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[str, int] = {}  # name -> the seed it was added with (a seed is used at most once)
        self.model_parallel_seeding: tuple[int, int] | None = None
        """(base seed, tensor rank) of the last ``seed_model_parallel`` ([Note: seeding before the tensor axis is
        known]); None when the model-parallel stream was not made that way."""

    @property
    def device(self) -> torch.device:
        """The device given at construction, else the accelerator *now*: a tracker made before
        ``torch.cuda.set_device(local_rank)`` must still drive the rank's own device."""
        return self._fixed_device if self._fixed_device is not None else accelerator_device()

    def reset(self) -> None:
        """Forget every named state (and the seeds used, so they may be added again)."""
        self._states = {}
        self._seeds = {}
        self.model_parallel_seeding = None

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the named states (the tensors are cloned: later forks cannot change the copy)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the named states, e.g. with ones from ``get_states`` (used to replay a recompute)."""
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create the state ``name``: the device generator's state right after seeding it with ``seed``.

        The device's default stream is left exactly where it was. Reusing a seed or a name is an error, as in
        DeepSpeed: two streams from one seed would draw identical "independent" masks.
        """
        if seed in self._seeds.values():
            raise ValueError(f"RNG tracker: seed {seed} is already used by another state; pick a different seed")
        if name in self._states:
            raise ValueError(f"RNG tracker: a state named {name!r} already exists; call reset() first")
        saved = get_rng_state(self.device)
        try:
            manual_seed(self.device, seed)
            self._states[name] = get_rng_state(self.device)
        finally:
            set_rng_state(self.device, saved)
        self._seeds[name] = seed

    def replace(self, name: str, seed: int) -> None:
        """Drop the state ``name`` (and its seed) if present, then ``add(name, seed)``."""
        self._states.pop(name, None)
        self._seeds.pop(name, None)
        self.add(name, seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the body on the named state; afterwards keep the advanced named state, restore the default one."""
        if name not in self._states:
            known = ", ".join(repr(n) for n in sorted(self._states)) or "none (call model_parallel_cuda_manual_seed)"
            raise KeyError(f"RNG tracker: no state named {name!r}; known states: {known}")
        outside = get_rng_state(self.device)
        set_rng_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = get_rng_state(self.device)
            set_rng_state(self.device, outside)


def seed_model_parallel(tracker: RNGStatesTracker, seed: int, tensor_rank: int) -> None:
    """DeepSpeed's ``model_parallel_cuda_manual_seed``, the one implementation: seed the default generator of
    ``tracker``'s device with ``seed`` (alike on every rank) and the tracker's model-parallel stream with
    ``seed + 2718 + tensor_rank`` (different per tensor rank). The tracker's other states are dropped."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"model-parallel seed {seed!r}: expected a non-negative integer")
    manual_seed(tracker.device, seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tensor_rank)
    tracker.model_parallel_seeding = (seed, tensor_rank)


def follow_tensor_rank(tracker: RNGStatesTracker, tensor_rank: int) -> bool:
    """Re-seed the model-parallel stream for ``tensor_rank`` if it was seeded for another one; True if it was.

    [Note: seeding before the tensor axis is known] The natural order in a script is "seed, then initialize":
    ``model_parallel_manual_seed(seed)`` runs on the default checkpointing context while its tensor axis is still
    the one-rank placeholder, so every rank seeds its model-parallel stream with ``seed + 2718 + 0`` and dropout in
    split regions would draw the same mask on every tensor rank. DeepSpeed avoids it by reading the rank from the
    mpu at seeding time (and failing without one); here the tracker remembers the base seed, and whoever learns the
    real tensor axis later (``configure()``, ``initialize``) calls this. Only the model-parallel stream is
    re-seeded: the default stream was seeded alike everywhere and has since been drawn from (model init), and a
    rank whose tensor rank did not change keeps its stream where it is (a re-``configure`` mid-run must not rewind
    it).
    """
    seeding = tracker.model_parallel_seeding
    if seeding is None or seeding[1] == tensor_rank:
        return False
    seed = seeding[0]
    tracker.replace(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tensor_rank)
    tracker.model_parallel_seeding = (seed, tensor_rank)
    return True


def _initialized_cuda_devices(extra: Iterable[torch.device]) -> list[torch.device]:
    """CUDA devices whose generators a checkpointed region may use: the current one and the inputs' devices.

    Only when CUDA is already initialised: reading a CUDA RNG state would otherwise start CUDA on a job that
    never uses it (torch's own checkpoint makes the same choice).
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    devices = {torch.device("cuda", torch.cuda.current_device())}
    devices.update(d for d in extra if d.type == "cuda")
    return sorted(devices, key=lambda d: d.index or 0)


@dataclass
class RngSnapshot:
    """Every RNG state a checkpointed region can draw from, captured at the start of its forward."""

    cpu_state: torch.Tensor
    device_states: dict[torch.device, torch.Tensor]
    tracker: RNGStatesTracker
    tracker_states: dict[str, torch.Tensor]

    @classmethod
    def capture(cls, tracker: RNGStatesTracker, input_devices: Iterable[torch.device] = ()) -> RngSnapshot:
        extra = list(input_devices)
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # else tracker.device could start CUDA
            extra.append(tracker.device)
        devices = _initialized_cuda_devices(extra)
        return cls(
            cpu_state=torch.get_rng_state(),
            device_states={d: torch.cuda.get_rng_state(d) for d in devices},
            tracker=tracker,
            tracker_states=tracker.get_states(),
        )

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the body (the recompute) on the captured states; put the current states back afterwards.

        The ``finally`` matters: torch's non-reentrant checkpoint ends a recompute early by raising once it has
        every tensor it needs, and the states must be restored on that path too.
        """
        current = RngSnapshot.capture(self.tracker, self.device_states)
        torch.set_rng_state(self.cpu_state)
        for device, state in self.device_states.items():
            torch.cuda.set_rng_state(state, device)
        self.tracker.set_states(self.tracker_states)
        try:
            yield
        finally:
            torch.set_rng_state(current.cpu_state)
            for device, state in current.device_states.items():
                torch.cuda.set_rng_state(state, device)
            self.tracker.set_states(current.tracker_states)
