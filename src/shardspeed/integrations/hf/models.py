"""Building Hugging Face models for ZeRO-3 without any rank holding them whole.

``from_config(model_config, ds_config)`` is ``AutoModelForCausalLM.from_config`` (or ``model_class.from_config``)
inside ``shardspeed.zero.Init``: the model is constructed on the meta device and materialized unit by unit by
``shardspeed.initialize`` at stage 3. No ``init_fn`` is needed for models whose weights ``zero.Init`` knows how to
initialize bitwise like a normal build (see ``zero/stage3/materialize.py``).
"""

from __future__ import annotations

from typing import Any

from shardspeed.config.load import ConfigSource


def zero3_init_context(ds_config: ConfigSource = None, enabled: bool = True) -> Any:
    """The context to construct a model in for ZeRO-3 (``zero.Init``); a no-op when ``enabled`` is False, which is
    how a script keeps one code path for every stage."""
    from shardspeed.zero import Init

    return Init(config_dict_or_path=ds_config, enabled=enabled)


def from_config(model_config: Any, ds_config: ConfigSource = None, model_class: Any = None, **kwargs: Any) -> Any:
    """``model_class.from_config(model_config, **kwargs)`` under ``zero.Init`` (default class:
    ``AutoModelForCausalLM``). ``ds_config``, when given, must be a stage-3 config."""
    if model_class is None:
        from transformers import AutoModelForCausalLM

        model_class = AutoModelForCausalLM
    with zero3_init_context(ds_config):
        return model_class.from_config(model_config, **kwargs)
