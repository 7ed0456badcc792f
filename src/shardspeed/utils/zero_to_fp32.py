"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` under shardspeed: the same helpers, and the CLI as a module.

``python -m shardspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT`` equals ``shardspeed zero-to-fp32 ...``.
"""

from __future__ import annotations

import sys

from shardspeed.checkpoint.consolidate import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
]

if __name__ == "__main__":
    sys.exit(main())
