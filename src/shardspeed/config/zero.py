"""``zero_optimization``: every DeepSpeed ZeRO key, typed, with DeepSpeed's defaults.

All keys are accepted so real configs parse, but a config may only *use* what shardspeed implements:
- ``stage`` must be in ``IMPLEMENTED_ZERO_STAGES`` (a stage we don't have is an error, never a silent
  fallback to stage 0, which would use several times the memory the user planned for);
- offload_optimizer devices must be in ``offload.IMPLEMENTED_OFFLOAD_DEVICES`` (stage ≥ 1; nvme needs a path);
  offload_param devices likewise at stage 3 (bf16/fp16 is checked by the engine, see zero/stage3/param_offload.py);
  below stage 3 offload_param has no effect in DeepSpeed (DeepSpeed-Chat writes it for every stage), so it is
  dropped with one warning (``without_inert_offload_param``), never an error;
- the keys in ``ZeroConfig.NOT_YET_SUPPORTED`` (ZeRO++, MiCS, ZenFlow: they change the numbers that are
  communicated or when updates are applied) must stay at their "off" values.
What every other key does (acts, warns once when set, or is refused) is declared in ``effects.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from pydantic import field_validator, model_validator

from .base import Int, InvalidValue, NonNegativeInt, PositiveInt, show
from .offload import IMPLEMENTED_OFFLOAD_DEVICES, OffloadOptimizerConfig, OffloadParamConfig
from .zero_stage3 import STAGE3_ALIASES, Stage3Options

IMPLEMENTED_ZERO_STAGES: frozenset[int] = frozenset({0, 1, 2, 3})
"""ZeRO stages shardspeed can run. Read at validation time, so adding a stage is a one-line change."""

_NOT_SUPPORTED = "is a DeepSpeed option shardspeed does not support yet"


_OLD_OFFLOAD_SPELLINGS: Mapping[str, str] = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def _is(default: Any) -> Callable[[Any], bool]:
    return lambda value: value == default


class ZeroConfig(Stage3Options):
    """``zero_optimization``: ZeRO memory partitioning (stage 0 = plain data parallelism)."""

    KEY_ALIASES: ClassVar[Mapping[str, str]] = STAGE3_ALIASES
    BOOL_MEANS: ClassVar[Mapping[bool, Mapping[str, Any]]] = {True: {"stage": 1}, False: {"stage": 0}}
    """DeepSpeed's legacy ``"zero_optimization": true`` (stage 1) / ``false`` (stage 0)."""
    AUTO_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset(
        {
            "reduce_bucket_size",
            "allgather_bucket_size",
            "sub_group_size",
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "model_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
        }
    )
    NOT_YET_SUPPORTED: ClassVar[Mapping[str, tuple[str, Callable[[Any], bool]]]] = {
        # field: (feature, is_off)
        "zero_quantized_weights": ("ZeRO++ quantized weight all-gather", _is(False)),
        "zero_quantized_nontrainable_weights": ("ZeRO++ quantized frozen weights", _is(False)),
        "zero_quantized_gradients": ("ZeRO++ quantized gradient reduction", _is(False)),
        "zero_hpz_partition_size": ("ZeRO++ hierarchical partitioning (hpZ)", lambda size: size <= 1),
        "zeropp_loco_param": ("LoCo-ZeRO++ error feedback", _is(None)),
        "mics_shard_size": ("MiCS sharding", lambda size: size <= 0),
        "mics_hierarchical_params_gather": ("MiCS hierarchical all-gather", _is(False)),
        "zenflow": ("ZenFlow asynchronous optimizer updates", _is(None)),
    }

    stage: Int = 0
    """0: no partitioning (data parallelism); 1: partition optimizer states; 2: also gradients; 3: also
    parameters. DeepSpeed default: 0. Must be one of ``IMPLEMENTED_ZERO_STAGES``."""

    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation).
    DeepSpeed default: true. shardspeed always does (flat buffers are how its buckets work); accepted for
    compatibility."""

    reduce_scatter: bool = True
    """Average gradients with reduce-scatter (or reduce) instead of all-reduce. DeepSpeed default: true.
    shardspeed's stages 1/2 always reduce-scatter (same numbers, half the traffic of an all-reduce); the key is
    accepted for compatibility."""

    reduce_bucket_size: PositiveInt = 500_000_000
    """Gradient elements reduced per collective. DeepSpeed default: 5e8. Unset (or ``"auto"``): the knee of the
    measured bandwidth curve when the collectives have one (gloo; [Note: collective algorithms] in
    comm/algorithms.py), else 5e8 (the HF Trainer would use hidden_size**2)."""

    use_multi_rank_bucket_allreduce: bool = True
    """Combine the ranks' reduce buckets into one all-reduce. DeepSpeed default: true."""

    allgather_partitions: bool = True
    """Gather updated parameter partitions with all-gather instead of a series of broadcasts.
    DeepSpeed default: true."""

    allgather_bucket_size: PositiveInt = 500_000_000
    """Parameter elements all-gathered per collective. DeepSpeed default: 5e8. Unset: the bandwidth knee, as
    ``reduce_bucket_size``."""

    overlap_comm: bool
    """Overlap gradient reduction with the backward pass: buckets are launched asynchronously from gradient
    hooks; at stages 0-2 at most two are in flight (``REDUCTIONS_IN_FLIGHT``; the oldest is finished before
    another launches), so stage 2's staging peaks at about three buckets. False makes each bucket's collective
    complete before the next launches (still inside backward; peak transient memory is one bucket). Default:
    true for every stage. DeepSpeed defaults it to false below stage 3 because its overlap needs extra bucket
    copies; ours does not, so we do not make the common case slower (it never changes numerics)."""

    overlap_param_gather: bool = True
    """Stages 1/2: the updated parameters' all-gather after the optimizer step is launched bucket by bucket and
    waited for by the first module of the next forward that uses a parameter in the bucket (as Megatron-Core's
    distributed optimizer does), instead of at the end of ``step()`` (DeepSpeed). Engine calls that expose
    parameters (state dicts, checkpoints, ``engine.parameters()``, ``GatheredParameters``, ``safe_get_*``) wait for
    pending gathers first; anything the forward's modules did not wait for is waited when the model's forward
    returns (the wrapped model's ``state_dict()`` / ``load_state_dict()`` wait too). A parent reading
    ``self.child.weight`` without calling the child (torch's ``MultiheadAttention`` and every ``nn.Transformer*``
    with ``out_proj``, a pipeline stage's tied ``forward_fn``) is handled: the forwards before the first step record
    it, and the nearest ancestor that runs waits for the child's buckets. Hazard: a parameter read directly between
    ``step()`` and the next forward (``model.parameters()``, ``layer.weight.data``, a submodule called on its own)
    may see a bucket still being written: read through the engine (``engine.parameters()``), call
    ``engine.states.wait_params()`` first, or set this to false. Not a DeepSpeed key (shardspeed's own). Default:
    true."""

    load_from_fp32_weights: bool = True
    """On checkpoint load, rebuild fp32 master weights from the saved fp32 copies (exact) rather than from
    the 16-bit model weights. DeepSpeed default: true."""

    elastic_checkpoint: bool = False
    """Legacy elastic ZeRO checkpoints (deprecated in DeepSpeed). DeepSpeed default: false."""

    offload_param: OffloadParamConfig | None = None
    """Parameter offload (stage 3): parameter shards in host memory ("cpu"; a no-op without an accelerator) or a
    swap file under ``nvme_path`` ("nvme") between uses; needs bf16/fp16 when it moves anything (see
    ``shardspeed.zero.stage3.param_offload``). DeepSpeed default: none."""

    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer-state offload (stages 1-3, Adam/AdamW): "cpu" or "nvme" (states in a swap file under
    ``nvme_path``, streamed in ``sub_group_size`` chunks). DeepSpeed default: none."""

    sub_group_size: PositiveInt = 1_000_000_000
    """Parameter elements per optimizer-step tile (bounds temporary memory). DeepSpeed default: 1e9."""

    cpu_offload: bool | None = None
    """Deprecated DeepSpeed spelling of ``offload_optimizer: {"device": "cpu"}``; true means that section (as in
    DeepSpeed, whose ``new_param_fn`` builds it; see ``_old_offload_spellings``). DeepSpeed default: none."""

    cpu_offload_param: bool | None = None
    """Deprecated DeepSpeed spelling of ``offload_param: {"device": "cpu"}``; true means that section. DeepSpeed
    default: none."""

    cpu_offload_use_pin_memory: bool | None = None
    """Deprecated DeepSpeed spelling of the offload sections' ``pin_memory``. DeepSpeed default: none."""

    ignore_unused_parameters: bool = True
    """Tolerate parameters that get no gradient (DeepSpeed stage 2 errors otherwise).
    DeepSpeed default: true."""

    legacy_stage1: bool = False
    """Select DeepSpeed's old stage-1 implementation (same math). DeepSpeed default: false."""

    round_robin_gradients: bool = False
    """Spread gradient copies to CPU across ranks (stage 1/2 with offload). DeepSpeed default: false."""

    compute_grad_norm: bool = True
    """Compute the global gradient norm on every stage 1/2 step even without clipping.
    DeepSpeed default: true."""

    parameter_alignment: bool = False
    """Pad stage 1/2 flat buffers so every parameter starts 16-byte aligned. DeepSpeed default: false."""

    zero_hpz_partition_size: NonNegativeInt = 1
    """ZeRO++ hpZ: ranks in the secondary (intra-node) parameter partition; 1 = off. DeepSpeed default: 1."""

    zero_quantized_weights: bool = False
    """ZeRO++: quantize weights for the all-gather. DeepSpeed default: false."""

    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++: store frozen weights quantized. DeepSpeed default: false."""

    zero_quantized_gradients: bool = False
    """ZeRO++: quantize gradients for the reduction. DeepSpeed default: false."""

    zeropp_loco_param: dict[str, Any] | None = None
    """LoCo-ZeRO++ error-feedback settings (``err_beta``, ``reset_T``). DeepSpeed default: none."""

    mics_shard_size: Int = -1
    """MiCS: ranks per parameter shard group; <= 0 = off. DeepSpeed default: -1."""

    mics_hierarchical_params_gather: bool = False
    """MiCS: gather parameters hierarchically (intra-node first). DeepSpeed default: false."""

    zenflow: dict[str, Any] | None = None
    """ZenFlow (stall-free offloaded optimizer updates) settings. DeepSpeed default: none."""

    @model_validator(mode="before")
    @classmethod
    def _default_overlap_comm(cls, data: Any) -> Any:
        """An absent or null ``overlap_comm`` means the default (true); DeepSpeed's default depends on the stage,
        ours does not (see the field)."""
        if isinstance(data, Mapping) and data.get("overlap_comm") is None:
            data = {**data, "overlap_comm": True}
        return data

    @model_validator(mode="before")
    @classmethod
    def _old_offload_spellings(cls, data: Any) -> Any:
        """``cpu_offload: true`` / ``cpu_offload_param: true`` become the offload section with device "cpu", as
        DeepSpeed translates them (old bing_bert / Megatron configs still carry them). Given together with the
        section, the two must agree (DeepSpeed refuses the pair outright)."""
        if not isinstance(data, Mapping):
            return data
        updates: dict[str, Any] = {}
        for old, section in _OLD_OFFLOAD_SPELLINGS.items():
            if data.get(old) is not True:
                continue
            given = data.get(section)
            if given is None:
                updates[section] = {"device": "cpu"}
                continue
            device = given.get("device", "none") if isinstance(given, Mapping) else getattr(given, "device", None)
            if device != "cpu":
                raise InvalidValue(
                    old,
                    f'"{{path}}" is true (DeepSpeed\'s old spelling of {section} with device "cpu") but "{section}" '
                    f'has device "{device}"; keep one',
                )
        return {**data, **updates} if updates else data

    @field_validator("stage")
    @classmethod
    def _stage_is_implemented(cls, stage: int) -> int:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        if stage not in IMPLEMENTED_ZERO_STAGES:
            implemented = ", ".join(str(s) for s in sorted(IMPLEMENTED_ZERO_STAGES))
            raise ValueError(
                f"ZeRO stage {stage} is not implemented in shardspeed yet (implemented: {implemented}); "
                "shardspeed never falls back to another stage silently"
            )
        return stage

    @model_validator(mode="after")
    def _only_implemented_features(self) -> ZeroConfig:
        if self.stage == 3:  # below stage 3 DeepSpeed ignores the section: see without_inert_offload_param
            _check_offload("offload_param", self.offload_param, stage_ok=True, stage_need="")
        _check_offload(
            "offload_optimizer",
            self.offload_optimizer,
            stage_ok=self.stage > 0,
            stage_need="needs ZeRO stage 1, 2 or 3 (the offloaded optimizer steps this rank's shard); set "
            "zero_optimization.stage",
        )
        for key, (feature, is_off) in self.NOT_YET_SUPPORTED.items():
            value = getattr(self, key)
            if not is_off(value):
                raise InvalidValue(
                    key,
                    f'"{{path}}" = {show(value)} {_NOT_SUPPORTED} ({feature}); remove it to use the default',
                )
        return self

    @property
    def uses_nvme(self) -> bool:
        """Whether either offload section swaps to NVMe (where bounded host memory matters most)."""
        return any(
            section is not None and section.device == "nvme" for section in (self.offload_optimizer, self.offload_param)
        )


def without_inert_offload_param(zero: ZeroConfig) -> tuple[ZeroConfig, str | None]:
    """``zero`` without an ``offload_param`` section that cannot act (stage < 3), plus the warning to log once.

    Why drop rather than refuse: DeepSpeed only reads offload_param at stage 3 and ignores it elsewhere, and
    generated configs (DeepSpeed-Chat) carry it for every stage. Dropping it means no deeper code can act on it."""
    section = zero.offload_param
    if zero.stage == 3 or section is None or section.device == "none":
        return zero, None
    warning = (
        f'"zero_optimization.offload_param" (device "{section.device}") has no effect at ZeRO stage {zero.stage} '
        "(only stage 3 shards the parameters); ignored, as DeepSpeed does"
    )
    return zero.model_copy(update={"offload_param": None}), warning


def _check_offload(key: str, section: Any, *, stage_ok: bool, stage_need: str) -> None:
    """The rules both offload sections share: an implemented device, the right stage, a path for nvme."""
    if section is None or section.device == "none":
        return
    if section.device not in IMPLEMENTED_OFFLOAD_DEVICES:
        raise InvalidValue(
            key,
            f'"{{path}}" with device "{section.device}" {_NOT_SUPPORTED}; valid devices: '
            f"{', '.join(sorted(IMPLEMENTED_OFFLOAD_DEVICES))}",
        )
    if not stage_ok:
        raise InvalidValue(key, f'"{{path}}" with device "{section.device}" {stage_need} or remove the section')
    if section.device == "nvme" and not section.nvme_path:
        raise InvalidValue(key, '"{path}" with device "nvme" needs "nvme_path": a writable directory on a local disk')
