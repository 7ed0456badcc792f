"""DeepSpeed's autotuner, driven by shardspeed's memory model (``shardspeed --autotuning tune|run``).

- ``probe.py``: the engine side of a trial (metric JSON, per-step progress, clean exit after the window).
- ``runner.py``: one trial = one real short launch through the launcher (never fatal).
- ``space.py``: the tuning space (stage, micro-batch/GAS, buckets, overlap, activation checkpointing, offload).
- ``activation.py`` / ``memory.py``: one profiled micro-batch + the model-state model → predicted bytes; pruning.
- ``tuners.py``: gridsearch / random / model_based (numpy ridge regression) with early stopping.
- ``results.py``: DeepSpeed's output files, the per-trial table, the plot.
- ``tune.py``: the whole flow (``args.py``: arg_mappings); ``command.py``: ``--autotuning tune|run``.
"""
