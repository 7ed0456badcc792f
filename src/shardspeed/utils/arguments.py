"""``add_config_arguments``: DeepSpeed's command-line flags for a training script's own argparse parser.

Adds, in an argument group named "DeepSpeed" as DeepSpeed does: ``--deepspeed`` (flag for the script's own use),
``--deepspeed_config PATH`` (read by ``initialize(args=args, ...)``), and the deprecated spellings
``--deepscale`` / ``--deepscale_config``. ``initialize`` accepts ``args.deepscale_config`` too (see ``api.py``).
"""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's config flags to ``parser`` and return it (the same object)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on the shardspeed backend)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the shardspeed backend)",
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file."
    )
    return parser


__all__ = ["add_config_arguments"]
