"""``deepspeed.moe`` (MoE layers, expert parallelism): not implemented yet; importing raises ImportError saying so."""

raise ImportError(
    "shardspeed.moe: mixture of experts (DeepSpeed's deepspeed.moe: layer.MoE, expert parallelism, "
    "utils.split_params_into_different_moe_groups_for_optimizer) is not implemented yet in shardspeed"
)
