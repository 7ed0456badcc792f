"""Per-sample metrics for ``shardspeed data-analyze``: built-ins and user functions.

A metric turns one sample (a sequence of token ids: tensor, array or list) into one integer. DeepSpeed's files
hold integers only, so a real-valued difficulty is scaled before it is stored (``vocab_rarity``: milli-nats).

- ``seqlen``: the number of tokens.
- ``vocab_rarity``: ``round(1000 × mean over the sample's tokens of −ln p(token))``, ``p`` the token's frequency
  over the whole dataset (rare words make a sample hard); needs a first pass counting tokens. An empty sample: 0.
- ``module:function``: a user function ``sample -> int`` (imported by path, as the launcher's subcommands are).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

BUILTIN_METRICS = ("seqlen", "vocab_rarity")
RARITY_SCALE = 1000.0


def tokens_of(sample: Any) -> np.ndarray:
    """A sample as a flat integer array (a tensor, array, list, or a dict/tuple whose first entry is the tokens)."""
    if isinstance(sample, dict):
        sample = sample.get("input_ids", next(iter(sample.values())))
    elif isinstance(sample, tuple):
        sample = sample[0]
    if hasattr(sample, "numpy"):
        sample = sample.numpy()
    return np.asarray(sample).reshape(-1)


def seqlen(sample: Any) -> int:
    return int(tokens_of(sample).size)


def rarity_values(token_counts: np.ndarray) -> np.ndarray:
    """−ln p per token id, from the dataset's token counts (ids never seen: 0, they never occur)."""
    total = float(token_counts.sum())
    with np.errstate(divide="ignore"):
        neg_log = -np.log(token_counts / total) if total else np.zeros(len(token_counts))
    neg_log[token_counts == 0] = 0.0
    return neg_log


def rarity_of(tokens: np.ndarray, neg_log_p: np.ndarray) -> int:
    if tokens.size == 0:
        return 0
    # A sequential sum (reduceat), as the indexed fast path takes it, so both paths round alike.
    return int(np.rint(RARITY_SCALE * (np.add.reduceat(neg_log_p[tokens], [0])[0] / tokens.size)))


def user_metric(spec: str) -> Callable[[Any], int]:
    """``"package.module:function"`` imported; a spec that is not one is an error naming it."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"metric {spec!r} is neither a built-in ({', '.join(BUILTIN_METRICS)}) nor 'module:function'")
    function = getattr(importlib.import_module(module_name), attribute, None)
    if not callable(function):
        raise ValueError(f"metric {spec!r}: {module_name} has no callable {attribute!r}")
    return function


def as_metric_value(value: Any, index: int, name: str) -> int:
    """A metric function's result as an int; anything else is an error naming the sample."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer, float, np.floating)):
        raise ValueError(f"metric {name!r} returned {value!r} for sample {index}: it must return an integer")
    if isinstance(value, (float, np.floating)) and not float(value).is_integer():
        raise ValueError(
            f"metric {name!r} returned {value!r} for sample {index}: DeepSpeed's metric files hold integers; "
            "scale and round the value in the metric function"
        )
    return int(value)
