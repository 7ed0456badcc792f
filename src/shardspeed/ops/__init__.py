"""DeepSpeed's ``deepspeed.ops`` optimizers under their DeepSpeed names, mapped onto shardspeed's own:
``ops.adam.FusedAdam`` and ``ops.adam.DeepSpeedCPUAdam`` (Adam/AdamW, stepping through
``offload.cpu_adam.cpu_adamw_step`` — torch's fused kernel), ``ops.lamb.FusedLamb`` (``optim.Lamb``).
No compiled extensions: nothing to build, the same classes run on CPU and CUDA."""
