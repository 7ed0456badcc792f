"""``engine.destroy()``: what an engine releases, in an order that survives a peer's failure.

The signal handlers go back first and the profiler's window closes (its dispatch mode and hooks); then the
gradient hooks, tensor-parallel hooks, the optimizer's and the stage's offload storage; the monitors close last,
whatever the cleanup before them did (files readable, a W&B run finished), and never raise. After a known failure
the monitors' last memory gather is not waited (a failed peer never joins it: [Note: one gather per step] in
monitor/listener.py).
"""

from __future__ import annotations

from typing import Any


def destroy_engine(engine: Any) -> None:
    engine.preemption.uninstall()
    engine.flops_profiler.close()  # a profile window still open: its hooks and dispatch mode go
    try:
        engine.states.reducer.remove_hooks()
        for handle in engine._tp_grad_hooks:  # sequence-parallel norms' gradient sums (tensor_parallel/)
            handle.remove()
        close = getattr(engine.optimizer, "close", None)
        if close is not None:
            close()
        close_states = getattr(engine.states, "close", None)  # stage 3 parameter offload
        if close_states is not None:
            close_states()
    finally:
        board = engine.collectives.board
        engine.monitor.close(peer_failed=board is not None and board.failure is not None)
