"""Tensor-parallel plans (tensor_parallel/plan.py, hf_plans.py): built from DeepSpeed layer_specs, HF tp_plans and
presets, matched against layer names without processes; a pattern matching nothing is an error naming it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed.config import load_config
from shardspeed.tensor_parallel.autotp import linear_layers
from shardspeed.tensor_parallel.hf_plans import PRESETS, hf_tp_plan_of, resolve_plan
from shardspeed.tensor_parallel.plan import (
    Plan,
    PlanError,
    PlanRule,
    hf_glob_to_regex,
    plan_from_hf_tp_plan,
    plan_from_layer_specs,
)

transformers = pytest.importorskip("transformers")

GPT2_LAYERS = [
    f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
] + ["lm_head"]
LLAMA_LAYERS = [
    f"model.layers.{i}.{m}"
    for i in range(2)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
] + ["lm_head"]


def _styles(assignment: dict[str, PlanRule]) -> dict[str, tuple[str, int]]:
    return {name: (rule.style, rule.parts) for name, rule in assignment.items()}


def test_gpt2_preset() -> None:
    got = _styles(PRESETS["gpt2"].assign(GPT2_LAYERS, "gpt2"))
    assert got == {
        **{f"transformer.h.{i}.attn.c_attn": ("column", 3) for i in range(2)},
        **{f"transformer.h.{i}.attn.c_proj": ("row", 1) for i in range(2)},
        **{f"transformer.h.{i}.mlp.c_fc": ("column", 1) for i in range(2)},
        **{f"transformer.h.{i}.mlp.c_proj": ("row", 1) for i in range(2)},
    }  # the LM head is not matched: replicated


def test_llama_preset() -> None:
    got = _styles(PRESETS["llama"].assign(LLAMA_LAYERS, "llama"))
    column = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    for name in LLAMA_LAYERS[:-1]:
        assert got[name] == ("column" if name.rsplit(".", 1)[1] in column else "row", 1), name
    assert "lm_head" not in got


def _specs(*specs: dict) -> tuple:
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": list(specs)}},
        },
        dp_world_size=1,
    )
    return cfg.tensor_parallel.layer_specs


def test_layer_specs_first_match_wins_and_skip_replicates() -> None:
    plan = plan_from_layer_specs(
        _specs(
            {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
            {"patterns": [r".*\.layers\.0\..*_proj$"], "partition_type": "skip"},
            {"patterns": [r".*_proj$"], "partition_type": "column"},
        )
    )
    got = _styles(plan.assign(LLAMA_LAYERS))
    assert got["model.layers.0.self_attn.o_proj"] == ("row", 1)  # matched through its weight name
    assert got["model.layers.0.mlp.down_proj"] == ("replicate", 1)  # the skip rule comes first
    assert got["model.layers.1.mlp.down_proj"] == ("column", 1)
    assert "lm_head" not in got


def test_fused_shape_gives_parts() -> None:
    plan = plan_from_layer_specs(
        _specs({"patterns": [r".*c_attn$"], "partition_type": "column", "shape": [3, -1], "partition_dim": 0})
    )
    assert _styles(plan.assign(GPT2_LAYERS))["transformer.h.1.attn.c_attn"] == ("column", 3)


def test_pattern_matching_nothing_is_an_error_naming_it() -> None:
    plan = plan_from_layer_specs(_specs({"patterns": [r".*\.o_proj$", r".*\.out_proj$"], "partition_type": "row"}))
    with pytest.raises(PlanError) as error:
        plan.assign(LLAMA_LAYERS)
    message = str(error.value)
    assert "'.*\\\\.out_proj$' (partition_config.layer_specs[0])" in message, message
    assert "o_proj$'" not in message.split("matching no linear layer")[1].split(". The model")[0]
    with pytest.raises(PlanError, match="preset gpt2"):
        PRESETS["gpt2"].assign(LLAMA_LAYERS)


def test_model_types_filter() -> None:
    plan = plan_from_layer_specs(
        _specs({"patterns": [r".*_proj$"], "partition_type": "column", "model_types": ["Llama"]})
    )
    assert len(plan.assign(LLAMA_LAYERS, "llama")) == 14
    assert plan.assign(LLAMA_LAYERS, "mistral") == {}  # filtered out: nothing required, nothing matched


def test_custom_then_preset() -> None:
    custom = plan_from_layer_specs(_specs({"patterns": [r".*\.mlp\..*"], "partition_type": "skip"}))
    got = _styles(custom.then(PRESETS["llama"]).assign(LLAMA_LAYERS))
    assert got["model.layers.0.mlp.up_proj"] == ("replicate", 1)
    assert got["model.layers.0.self_attn.q_proj"] == ("column", 1)


def test_hf_glob() -> None:
    regex = hf_glob_to_regex("model.layers.*.self_attn.q_proj")
    rule = PlanRule(regex, "column")
    assert rule.matches("model.layers.11.self_attn.q_proj")
    assert not rule.matches("model.layers.1.self_attn.q_proj_extra")
    assert not rule.matches("x.model.layers.1.self_attn.q_proj")


def test_hf_styles_map_and_refuse() -> None:
    plan = plan_from_hf_tp_plan(
        {
            "model.layers.*.self_attn.o_proj": "rowwise",
            "lm_head": "colwise_rep",
            "model.layers.*.mlp.up_proj": "rowwise_rep",
        }
    )
    got = plan.assign(LLAMA_LAYERS)
    assert got["lm_head"].style == "column" and got["lm_head"].gather_output
    assert got["model.layers.0.mlp.up_proj"].style == "row" and not got["model.layers.0.mlp.up_proj"].input_is_parallel
    with pytest.raises(PlanError) as error:
        plan_from_hf_tp_plan({"layers.*.mlp": "gather", "layers.*.mlp.up_proj": "local_colwise", "x": "bogus"})
    message = str(error.value)
    assert (
        "'layers.*.mlp': 'gather'" in message and "'local_colwise'" in message and "'bogus' (unknown style)" in message
    )


def test_hf_plan_keys_that_miss_are_tolerated_but_a_plan_matching_nothing_is_not() -> None:
    plan = plan_from_hf_tp_plan({"layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.q_proj": "colwise"})
    assert len(plan.assign(LLAMA_LAYERS)) == 2
    with pytest.raises(PlanError, match="matches none of the model's linear layers"):
        plan.assign(GPT2_LAYERS)


def _tiny_llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _tp_settings(**section):
    return load_config(
        {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2, **section}}, dp_world_size=1
    ).tensor_parallel


def test_resolve_order() -> None:
    llama = _tiny_llama()
    assert set(hf_tp_plan_of(llama)) >= {"model.layers.*.self_attn.q_proj"}
    assert resolve_plan(llama, _tp_settings()).source == "the model's Hugging Face tp_plan"
    custom = resolve_plan(
        llama, _tp_settings(preset_model="llama", partition_config={"layer_specs": [{"patterns": ["lm_head"]}]})
    )
    assert custom.source == "partition_config.layer_specs, then preset llama"
    alone = resolve_plan(
        llama,
        _tp_settings(
            preset_model="llama",
            partition_config={"use_default_specs": False, "layer_specs": [{"patterns": ["lm_head"]}]},
        ),
    )
    assert alone.source == "partition_config.layer_specs"
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32))
    assert hf_tp_plan_of(gpt2) == {}
    assert resolve_plan(gpt2, _tp_settings()).source == "preset gpt2"  # from config.model_type
    assert sorted(linear_layers(gpt2)) == sorted(
        ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
         "transformer.h.0.mlp.c_proj", "lm_head"]
    )  # fmt: skip
    with pytest.raises(PlanError, match="no tensor-parallel plan for Sequential"):
        resolve_plan(nn.Sequential(nn.Linear(2, 2)), _tp_settings())


def test_plan_rule_validation() -> None:
    with pytest.raises(PlanError, match="gather_output needs a column rule"):
        PlanRule("x", "row", gather_output=True)
    with pytest.raises(PlanError, match="not a regular expression"):
        PlanRule("(", "column")
    assert Plan((), "empty").assign(["a"]) == {}


# --- apply_tensor_parallel's refusals: every check runs before any collective, so a fake 2-rank axis suffices ---


def _fake_tp(sequence_parallel: bool = False):
    from shardspeed.tensor_parallel import TensorParallel
    from shardspeed.topology import AxisGroup

    return TensorParallel(AxisGroup("tensor", None, (0, 1), 0), sequence_parallel=sequence_parallel)


def _tiny_gpt2(**overrides) -> nn.Module:
    fields = {"n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 32, "n_positions": 8, **overrides}
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields))


def test_apply_refuses_meta_models() -> None:
    from shardspeed.tensor_parallel.autotp import apply_tensor_parallel

    with torch.device("meta"):
        model = _tiny_gpt2()
    with pytest.raises(NotImplementedError, match=r"meta device .*zero\.Init"):
        apply_tensor_parallel(model, _fake_tp(), _tp_settings())


def test_apply_refuses_tied_sliced_weights() -> None:
    from shardspeed.tensor_parallel.autotp import apply_tensor_parallel

    model = _tiny_gpt2()  # lm_head is tied to wte: slicing it column-wise would cut the embedding too
    settings = _tp_settings(partition_config={"layer_specs": [{"patterns": ["lm_head"], "gather_output": True}]})
    with pytest.raises(PlanError, match=r"cannot slice 'lm_head': its weight is shared \(tied\) with transformer\.wte"):
        apply_tensor_parallel(model, _fake_tp(), settings)
    assert type(model.lm_head) is nn.Linear  # nothing was replaced


def test_strict_mode_names_unmatched_layers() -> None:
    from shardspeed.tensor_parallel.autotp import apply_tensor_parallel

    settings = _tp_settings(
        preset_model="gpt2", partition_config={"strict_mode": True, "layer_specs": [{"patterns": [".*c_fc$"]}]}
    )
    with pytest.raises(PlanError, match=r"strict_mode: .* matches these linear layers: lm_head"):
        apply_tensor_parallel(_tiny_gpt2(), _fake_tp(), settings)


def test_sequence_parallel_refusals() -> None:
    from shardspeed.tensor_parallel.autotp import apply_tensor_parallel

    with pytest.raises(ValueError, match="sequence_parallel is True but the TensorParallel passed has"):
        apply_tensor_parallel(_tiny_gpt2(), _fake_tp(), _tp_settings(sequence_parallel=True))


def test_sequence_parallel_plan_accepts_dropout_in_the_blocks() -> None:
    """GPT-2's default dropouts (0.1) inside the blocks get per-rank streams instead of a refusal (autotp_dropout.py);
    the embedding dropout, outside the region, does not count."""
    from shardspeed.tensor_parallel.autotp_sequence import plan_sequence_parallel

    sliced = [f"transformer.h.0.{n}" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert plan_sequence_parallel(_tiny_gpt2(), sliced).dropout
    assert not plan_sequence_parallel(_tiny_gpt2(resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.5), sliced).dropout


@pytest.mark.parametrize(
    ("overrides", "numbers"),
    [({"num_key_value_heads": 1}, "4 attention heads and 1 key-value heads"), ({"num_attention_heads": 3,
      "num_key_value_heads": 3, "hidden_size": 24}, "3 attention heads and 3 key-value heads")],
)  # fmt: skip
def test_indivisible_heads_are_an_error_naming_the_numbers(overrides, numbers) -> None:
    from shardspeed.tensor_parallel.autotp import apply_tensor_parallel

    fields = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 32, **overrides}  # fmt: skip
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    with pytest.raises(PlanError) as error:
        apply_tensor_parallel(model, _fake_tp(), _tp_settings())
    assert f"LlamaForCausalLM (llama) has {numbers}" in str(error.value)
    assert "divisible by the tensor-parallel size 2" in str(error.value)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear


def test_autotp_size_must_be_the_tensor_axis() -> None:
    from shardspeed.tensor_parallel.autotp import apply_tensor_parallel

    with pytest.raises(ValueError, match="autotp_size is 4 but the tensor axis passed has 2 rank"):
        apply_tensor_parallel(_tiny_gpt2(), _fake_tp(), _tp_settings(autotp_size=4))
    model = _tiny_gpt2()
    assert apply_tensor_parallel(model, _fake_tp(), _tp_settings(autotp_size=0)) is model  # off: untouched
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
