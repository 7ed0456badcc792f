"""FLOP counting with module attribution (torch's ``FlopCounterMode``), DeepSpeed's flops profiler and MFU.

``session.py`` counts one window, ``formulas.py`` adds the attention ops torch's table lacks, ``summary.py`` renders
DeepSpeed's printout, ``engine_profiler.py`` is ``engine.flops_profiler``, ``flops_profiler/`` is DeepSpeed's
standalone API (``get_model_profile``, ``FlopsProfiler``), ``mfu.py`` the peak table, the CPU probe and MFU.
"""
