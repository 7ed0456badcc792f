"""A trial's values into the DeepSpeed config and the script's arguments (pure)."""

from __future__ import annotations

import pytest

pytest.importorskip("optuna")

from shardspeed.autotuning.hpo.space import SpaceError
from shardspeed.autotuning.hpo.substitute import apply_to_args, apply_to_config, split_config_arg

BASE = {
    "train_batch_size": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-3}},
    "zero_optimization": {"stage": 1},
}


def test_aliases_and_dotted_paths_set_the_keys_and_leave_the_input_alone() -> None:
    params = {"lr": 0.05, "weight_decay": 0.1, "warmup_steps": 3, "zero_optimization.stage": 2, "--dropout": 0.2}
    config = apply_to_config(BASE, params)
    assert config["optimizer"]["params"] == {"lr": 0.05, "weight_decay": 0.1}
    # WarmupLR drives the lr to warmup_max_lr: the searched lr must land there too.
    assert config["scheduler"]["params"] == {"warmup_num_steps": 3, "warmup_max_lr": 0.05}
    assert config["zero_optimization"]["stage"] == 2
    assert "--dropout" not in str(config)
    assert BASE["optimizer"]["params"] == {"lr": 1e-3} and BASE["zero_optimization"]["stage"] == 1


def test_lr_leaves_other_schedulers_alone_and_batch_size_drops_the_global_batch() -> None:
    base = {**BASE, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}}
    config = apply_to_config(base, {"lr": 0.3, "batch_size": 4})
    assert config["scheduler"]["params"] == {"total_num_steps": 100}
    assert config["train_micro_batch_size_per_gpu"] == 4 and "train_batch_size" not in config


def test_deeper_levels_are_created_but_a_missing_section_is_an_error() -> None:
    config = apply_to_config(BASE, {"zero_optimization.offload_optimizer.device": "cpu", "steps_per_print": 5})
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"} and config["steps_per_print"] == 5
    with pytest.raises(SpaceError, match=r"params\['warmup_steps'\] sets scheduler.params.warmup_num_steps, but"):
        apply_to_config({"optimizer": {"type": "SGD"}}, {"warmup_steps": 5})
    with pytest.raises(SpaceError, match=r"optimizer.params is 3, not a section"):
        apply_to_config({"optimizer": {"params": 3}}, {"lr": 0.1})


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--steps", "9"], ["--steps", "9", "--dropout", "0.25"]),
        (["--dropout", "0.1", "--steps", "9"], ["--steps", "9", "--dropout", "0.25"]),
        (["--dropout=0.1", "--steps", "9"], ["--steps", "9", "--dropout", "0.25"]),
        (["--dropout", "--steps", "9"], ["--steps", "9", "--dropout", "0.25"]),  # a bare flag has no value
        (["--dropout_p", "7"], ["--dropout_p", "7", "--dropout", "0.25"]),  # a longer name is another flag
    ],
)
def test_script_arguments_are_replaced_or_appended(args: list[str], expected: list[str]) -> None:
    assert apply_to_args(args, {"--dropout": 0.25, "lr": 1.0}) == expected


def test_boolean_values_are_bare_flags_and_ints_stay_ints() -> None:
    assert apply_to_args(["--amp", "--x", "1"], {"--amp": False}) == ["--x", "1"]
    assert apply_to_args(["--x", "1"], {"--amp": True, "--layers": 4}) == ["--x", "1", "--amp", "--layers", "4"]


def test_the_config_flag_is_split_off() -> None:
    assert split_config_arg(["--a", "1", "--deepspeed_config", "c.json", "--b"]) == ("c.json", ["--a", "1", "--b"])
    assert split_config_arg(["--deepspeed_config=c.json"]) == ("c.json", [])
    assert split_config_arg(["--a"]) == (None, ["--a"])
    with pytest.raises(SpaceError, match="needs a path"):
        split_config_arg(["--deepspeed_config"])


def test_the_lr_coupling_follows_the_resolved_path() -> None:
    """Review G #2: the dotted form must couple as the alias does; OneCycle/LRRangeTest refuse a no-op lr."""
    assert apply_to_config(BASE, {"optimizer.params.lr": 0.5})["scheduler"]["params"]["warmup_max_lr"] == 0.5
    one_cycle = {**BASE, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2}}}
    with pytest.raises(SpaceError, match=r"OneCycle .* search 'scheduler.params.cycle_max_lr' instead"):
        apply_to_config(one_cycle, {"optimizer.params.lr": 0.5})
    range_test = {**BASE, "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4}}}
    with pytest.raises(SpaceError, match=r"search 'scheduler.params.lr_range_test_min_lr'"):
        apply_to_config(range_test, {"lr": 0.5})
    assert apply_to_config(one_cycle, {"scheduler.params.cycle_max_lr": 0.5})["scheduler"]["params"]["cycle_max_lr"]


def _triple(config: dict) -> tuple[int | None, int | None, int | None]:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    return tuple(config.get(key) for key in keys)  # type: ignore[return-value]


def test_batch_couplings_keep_the_users_unsearched_key_and_stay_consistent() -> None:
    """Review G #3: GAS search kept an inconsistent triple; micro search lost an inferred accumulation."""
    written = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}
    # GAS searched: the user's micro-batch stays, the global batch is inferred (no 8 / 4 / 2 at world 2).
    assert _triple(apply_to_config(written, {"gradient_accumulation_steps": 2}, 2)) == (None, 4, 2)
    # micro searched (alias or dotted) with an inferred GAS (32 / (4 x 2) = 4): the accumulation is pinned.
    inferred = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}
    for name in ("batch_size", "train_micro_batch_size_per_gpu"):
        assert _triple(apply_to_config(inferred, {name: 4}, 2)) == (None, 4, 4)
        assert _triple(apply_to_config(inferred, {name: 8}, 2)) == (None, 8, 4)
    # Only train_batch_size written: DeepSpeed's GAS is 1; micro and GAS both searched: both kept, global inferred.
    assert _triple(apply_to_config({"train_batch_size": 16}, {"batch_size": 2}, 2)) == (None, 2, 1)
    both = apply_to_config(inferred, {"batch_size": 2, "gradient_accumulation_steps": 3}, 2)
    assert _triple(both) == (None, 2, 3)
    # train_batch_size searched: the user's micro-batch stays, the accumulation is inferred.
    full = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
    assert _triple(apply_to_config(full, {"train_batch_size": 64}, 2)) == (64, 4, None)
