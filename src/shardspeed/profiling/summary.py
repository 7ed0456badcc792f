"""DeepSpeed's profile printout (``print_model_profile``), rendered as lines from a window's figures.

The labels are DeepSpeed 0.19.8's, so scripts and eyes that read its output find the same lines. What differs:
- "per GPU" figures cover the whole profiled optimizer step (every micro-batch of it), not one forward;
- the backward/step lines are always printed (the engine times its phases while profiling; DeepSpeed needs
  ``wall_clock_breakdown``), and we add measured lines DeepSpeed has no equivalent for: the backward FLOPs as
  counted, the recomputed forward FLOPs, model FLOPs per sample, the peak and MFU;
- "params of model" / "fwd flops of model" are sums over the tensor and pipeline ranks (replicated parameters
  once) rather than ``per GPU * mp_size``; the label says so whenever the two can differ (mp_size > 1);
- the per-module tree is ours (no ``extra_repr`` patching): DeepSpeed's items, then the module's backward flops
  and backward latency.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from shardspeed.profiling.session import ModuleStats, WindowFigures
from shardspeed.profiling.units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

_LINE = "{:<70}  {:<8}"
_NOTATIONS = (
    "Notations:\n"
    "data parallel size (dp_size), model parallel size(mp_size),\n"
    "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
    "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
    "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
    "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n"
)


@dataclass(frozen=True)
class EngineContext:
    """What the engine adds to a standalone profile."""

    world_size: int
    dp_size: int
    mp_size: int
    micro_batch_size: int
    samples_per_step: int
    """Samples of the profiled step over the whole data-parallel group (``train_batch_size``)."""
    recompute_fwd_factor: float
    model_params: int
    """Parameters of the whole model (summed over the tensor and pipeline ranks)."""
    model_fwd_flops: int
    model_flops_per_sample: float
    peak_flops: float | None = None
    peak_source: str = ""
    mfu: float | None = None


def render_profile(
    fig: WindowFigures,
    profile_step: int,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    engine: EngineContext | None = None,
) -> list[str]:
    lines = ["", "-------------------------- DeepSpeed Flops Profiler --------------------------"]
    lines.append(f"Profile Summary at step {profile_step}:")
    lines.extend(_NOTATIONS.split("\n"))
    add = lambda label, value: lines.append(_LINE.format(label, value))  # noqa: E731
    fwd_flops, fwd_s = fig.flops("forward"), fig.seconds("forward")
    mp = engine.mp_size if engine is not None else 1
    if engine is not None:
        add("world size: ", engine.world_size)
        add("data parallel size: ", engine.dp_size)
        add("model parallel size: ", engine.mp_size)
        add("batch size per GPU: ", engine.micro_batch_size)
    add("params per GPU: ", params_to_string(fig.params))
    model_params = engine.model_params if engine is not None else fig.params
    add(
        "params of model = params per GPU * mp_size: " if mp == 1 else "params of model (sum over tensor/pipe ranks): ",
        params_to_string(model_params),
    )
    add("fwd MACs per GPU: ", macs_to_string(fwd_flops // 2))
    add("fwd flops per GPU: ", number_to_string(fwd_flops))
    model_fwd = engine.model_fwd_flops if engine is not None else fwd_flops
    add(
        "fwd flops of model = fwd flops per GPU * mp_size: "
        if mp == 1
        else "fwd flops of model (sum over tensor/pipe ranks): ",
        number_to_string(model_fwd),
    )
    add("fwd latency: ", duration_to_string(fwd_s))
    add("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(_ratio(fwd_flops, fwd_s)))
    if engine is not None:
        lines.extend(_engine_lines(fig, engine))
    lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
    lines.extend(aggregated_lines(fig, module_depth, top_modules))
    if detailed:
        lines += ["", "------------------------------ Detailed Profile per GPU ------------------------------"]
        lines.append("Each module profile is listed after its name in the following order: ")
        lines.append(
            "params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total "
            "fwd latency, fwd FLOPS, bwd flops, bwd latency"
        )
        lines.append(
            "\nNote: 1. FLOPs are counted by torch's FlopCounterMode: matmuls, convolutions and attention only "
            "(element-wise ops such as norms, activations and the loss count 0), so MACs = flops / 2.\n"
            "2. Work outside submodules (functionals called in a parent's forward) makes up the difference between "
            "a parent's MACs (or latency) and the sum of its submodules'.\n"
            "3. Parameters are full counts under ZeRO-3 and this rank's slices under tensor parallelism.\n"
            "4. bwd flops per module are as torch's ModuleTracker attributes them (the total is exact); a module that "
            "returns its input unchanged (Dropout(p=0), Identity) can be charged its neighbours' backward.\n"
        )
        lines.extend(tree_lines(fig).split("\n"))
    lines.append("------------------------------------------------------------------------------")
    return lines


def _engine_lines(fig: WindowFigures, engine: EngineContext) -> list[str]:
    lines: list[str] = []
    add = lambda label, value: lines.append(_LINE.format(label, value))  # noqa: E731
    fwd_flops, fwd_s = fig.flops("forward"), fig.seconds("forward")
    bwd_s, step_s = fig.seconds("backward"), fig.seconds("step")
    factor = 2 + engine.recompute_fwd_factor  # DeepSpeed's hardware-FLOPs rule for the backward
    add("bwd latency: ", duration_to_string(bwd_s))
    add(
        f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
        flops_to_string(_ratio(factor * fwd_flops, bwd_s)),
    )
    add(
        f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
        flops_to_string(_ratio((factor + 1) * fwd_flops, fwd_s + bwd_s)),
    )
    add("step latency: ", duration_to_string(step_s))
    iter_s = fig.wall_seconds  # first forward → end of the optimizer step: includes pipeline waits
    add("iter latency: ", duration_to_string(iter_s))
    add(
        f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
        flops_to_string(_ratio((factor + 1) * fwd_flops, iter_s)),
    )
    add("samples/second: ", round(_ratio(engine.samples_per_step, iter_s), 2))
    add("bwd flops per GPU (counted): ", number_to_string(fig.flops("backward")))
    add("recomputed fwd flops per GPU (counted, in bwd): ", number_to_string(fig.recompute_flops))
    add(
        "model flops per sample (fwd+bwd of the whole model, no recompute): ",
        number_to_string(engine.model_flops_per_sample),
    )
    if engine.peak_flops is not None:
        add(f"peak FLOPS per device ({engine.peak_source}): ", flops_to_string(engine.peak_flops))
    if engine.mfu is not None:
        add("MFU = model flops per sample * samples/second / (world size * peak): ", f"{100 * engine.mfu:.2f}%")
    return lines


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _children(fig: WindowFigures) -> dict[str, list[ModuleStats]]:
    kids: dict[str, list[ModuleStats]] = defaultdict(list)
    for stats in fig.modules[1:]:
        kids[stats.path.rpartition(".")[0]].append(stats)
    return kids


def _duration(stats: ModuleStats, kids: dict[str, list[ModuleStats]], field: str = "fwd_latency") -> float:
    """A container never called (``ModuleList``) takes its children's time, as in DeepSpeed."""
    if stats.fwd_latency:
        return getattr(stats, field)
    return sum(_duration(k, kids, field) for k in kids.get(stats.path, []))


def _flops(stats: ModuleStats, kids: dict[str, list[ModuleStats]], field: str) -> int:
    own = getattr(stats, field)
    if own or stats.fwd_latency:
        return own
    return sum(_flops(k, kids, field) for k in kids.get(stats.path, []))


def aggregated_lines(fig: WindowFigures, module_depth: int, top_modules: int) -> list[str]:
    """The top ``top_modules`` module classes by params, MACs and forward latency at each depth."""
    kids = _children(fig)
    info: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    for stats in fig.modules:
        entry = info[stats.depth][type(stats.module).__name__]
        entry[0] += _flops(stats, kids, "fwd_flops") // 2
        entry[1] += stats.params
        entry[2] += _duration(stats, kids)
    depth = len(info) - 1 if module_depth == -1 else module_depth
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for d in range(min(depth, len(info))):
        rows = info[d]
        n = min(top_modules, len(rows))

        lines.append(f"depth {d}:")
        lines.append(f"    params      - {_top(rows, n, 1, params_to_string)}")
        lines.append(f"    MACs        - {_top(rows, n, 0, macs_to_string)}")
        lines.append(f"    fwd latency - {_top(rows, n, 2, duration_to_string)}")
    return lines


def _top(rows: dict[str, list[float]], n: int, i: int, fmt: Callable[[float], str]) -> dict[str, str]:
    ranked = sorted(rows.items(), key=lambda item: item[1][i], reverse=True)[:n]
    return {name: fmt(values[i]) for name, values in ranked}


def tree_lines(fig: WindowFigures) -> str:
    """The module tree laid out like ``print(model)``, each module with its profile."""
    kids = _children(fig)
    root = fig.modules[0]
    total_params = root.params
    total_macs = fig.flops("forward") // 2
    total_s = _duration(root, kids)

    def pct(part: float, whole: float) -> str:
        return f"{round(100 * part / whole, 2) if whole else 0:g}%"

    def describe(stats: ModuleStats) -> str:
        macs = _flops(stats, kids, "fwd_flops") // 2
        seconds = _duration(stats, kids)
        items = [
            f"{params_to_string(stats.params)} = {pct(stats.params, total_params)} Params",
            f"{macs_to_string(macs)} = {pct(macs, total_macs)} MACs",
            f"{duration_to_string(seconds)} = {pct(seconds, total_s)} latency",
            flops_to_string(round(2 * macs / seconds, 2) if seconds else 0),
            f"{number_to_string(_flops(stats, kids, 'bwd_flops'))}bwd flops",
            f"{duration_to_string(_duration(stats, kids, 'bwd_latency'))} bwd latency",
        ]
        extra = stats.module.extra_repr()
        if extra:
            items.append(extra)
        return ", ".join(items)

    def render(stats: ModuleStats) -> str:
        name = type(stats.module).__name__
        children = kids.get(stats.path, [])
        if not children:
            return f"{name}({describe(stats)})"
        body = [f"  {describe(stats)}"]
        for child in children:
            text = render(child).replace("\n", "\n  ")
            body.append(f"  ({child.path.rpartition('.')[2]}): {text}")
        return f"{name}(\n" + "\n".join(body) + "\n)"

    return render(root)
