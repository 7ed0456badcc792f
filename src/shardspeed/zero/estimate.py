"""``shardspeed estimate``: print the ZeRO model-state memory table for a parameter count.

Example: ``shardspeed estimate --params 7.5e9 --num_gpus 64`` prints the ZeRO paper's 120.0 / 31.4 / 16.6 / 1.9
GB per GPU for stages 0-3, plus CPU-offload rows. ``--num_gpus`` is GPUs *per node*, as in DeepSpeed's
estimators and launcher, so the data-parallel degree is ``--num_gpus`` x ``--num_nodes``.
"""

from __future__ import annotations

import argparse
import sys
from decimal import Decimal, InvalidOperation

from shardspeed.zero.memory import ACCOUNTINGS, PRECISIONS, estimate_zero_memory, format_table

PROGRAM = "shardspeed estimate"

# Suffixes people write model sizes with ("350M", "7.5B", "1T"); B and G both mean 1e9.
_PARAM_SUFFIXES: dict[str, int] = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_param_count(text: str) -> int:
    """Parse a parameter count: ``7500000000``, ``7.5e9``, ``7_500_000_000``, ``7.5B``, ``350M``, ``1.3b``.

    Decimal arithmetic keeps ``7.5B`` and ``1.3e9`` exact (a float would make 1.3e9 * 1 = 1299999999.99...).
    The result must be a positive whole number.
    """
    cleaned = text.strip().replace("_", "")
    scale = 1
    if cleaned and cleaned[-1].upper() in _PARAM_SUFFIXES:
        scale = _PARAM_SUFFIXES[cleaned[-1].upper()]
        cleaned = cleaned[:-1]
    valid = "write e.g. 7500000000, 7.5e9, 7.5B, 350M (suffixes: K, M, B or G, T)"
    try:
        value = Decimal(cleaned) * scale
    except InvalidOperation:
        raise ValueError(f"parameter count {text!r} is not a number; {valid}") from None
    if not value.is_finite() or value != value.to_integral_value():
        raise ValueError(f"parameter count {text!r} is not a whole number; {valid}")
    if value <= 0:
        raise ValueError(f"parameter count {text!r} must be positive; {valid}")
    return int(value)


def _param_count_argument(text: str) -> int:
    try:
        return parse_param_count(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _buffer_factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1.0")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``shardspeed estimate`` argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description=(
            "Estimate per-GPU memory of model states (parameters, gradients, optimizer states) for ZeRO stages "
            "0-3, with and without CPU offload. Activations and temporary buffers are not included."
        ),
        allow_abbrev=False,
    )
    parser.add_argument(
        "--params", required=True, type=_param_count_argument, help="trainable parameters: 7.5e9, 7.5B, 350M, ..."
    )
    parser.add_argument("--num_gpus", type=_positive_int, default=1, help="GPUs per node (default 1)")
    parser.add_argument("--num_nodes", type=_positive_int, default=1, help="nodes (default 1)")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="mixed",
        help="mixed: fp16/bf16 + fp32 master (default); fp32; bf16: bf16 masters and states",
    )
    parser.add_argument(
        "--accounting",
        choices=ACCOUNTINGS,
        default="paper",
        help="paper: the ZeRO paper's byte counts (default); shardspeed: what shardspeed's engine allocates",
    )
    parser.add_argument(
        "--optimizer_bytes",
        type=int,
        default=None,
        metavar="K",
        help="optimizer-state bytes per parameter, master copy included (default 12 mixed, 8 fp32: Adam)",
    )
    parser.add_argument(
        "--additional_buffer_factor",
        type=_buffer_factor,
        default=1.0,
        help="multiply CPU memory by this headroom factor (default 1.0; DeepSpeed's estimators use 1.5)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``shardspeed estimate``; returns the exit code (2 for bad arguments, with the reason on stderr)."""
    parser = build_parser()
    try:
        options = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_request:  # --help (0) or a usage error (2, already printed by argparse)
        code = exit_request.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    try:
        rows = estimate_zero_memory(
            num_params=options.params,
            num_gpus_per_node=options.num_gpus,
            num_nodes=options.num_nodes,
            precision=options.precision,
            accounting=options.accounting,
            additional_buffer_factor=options.additional_buffer_factor,
            optimizer_state_bytes_per_param=options.optimizer_bytes,
            print_table=False,
        )
    except ValueError as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
