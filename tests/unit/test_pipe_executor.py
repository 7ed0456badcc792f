"""The executor over every schedule without processes: each stage runs in a thread, links are in-memory FIFO
queues shared by both message kinds (a receive checks that the next message on its link is the one it expects,
so a schedule/executor mismatch in order is an error, not a wrong result). The pipelined gradients equal one
process's sequential forward/backward; only the first and last virtual stages read data, each micro-batch once;
the live activations never exceed the schedule's buffers (1F1B: min(p − s, m))."""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import nn

from shardspeed.pipe.buffers import PipeBuffers
from shardspeed.pipe.data import StageData, as_tuple
from shardspeed.pipe.executor import PipeExecutor
from shardspeed.pipe.schedule import build_schedule

DIM = 3


class Fabric:
    """FIFO links between stages (one queue per directed link, whatever the stream: instructions.py)."""

    def __init__(self) -> None:
        self.links: dict[tuple[int, int], queue.Queue] = defaultdict(queue.Queue)
        self.lock = threading.Lock()

    def link(self, src: int, dst: int) -> queue.Queue:
        with self.lock:
            return self.links[(src, dst)]


class QueueChannel:
    def __init__(self, fabric: Fabric, rank: int) -> None:
        self.fabric, self.rank = fabric, rank
        self.sent = 0

    def send(self, tensors: tuple[torch.Tensor, ...], peer: int, stream: str) -> None:
        copies = tuple(t.detach().clone().requires_grad_(t.requires_grad and t.is_floating_point()) for t in tensors)
        self.fabric.link(self.rank, peer).put((stream, copies))
        self.sent += 1

    def recv(self, peer: int, stream: str) -> tuple[torch.Tensor, ...]:
        got, tensors = self.fabric.link(peer, self.rank).get(timeout=20)
        assert got == stream, f"rank {self.rank}: expected {stream} from {peer}, the link's next message is {got}"
        return tensors

    def exchange(self, sends: list, recvs: list) -> list[tuple[torch.Tensor, ...]]:
        for tensors, peer, stream in sends:
            self.send(tensors, peer, stream)
        return [self.recv(peer, stream) for peer, stream in recvs]

    def wait_sends(self) -> None:
        pass


class Chunks(nn.Module):
    """Stage ``s``'s chunks: chunk ``c`` is virtual stage ``c·p + s``, one seeded linear layer."""

    def __init__(self, stages: int, stage: int, chunks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_layer(c * stages + stage) for c in range(chunks))

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        return torch.tanh(self.layers[chunk](x))


def _layer(virtual: int) -> nn.Linear:
    torch.manual_seed(100 + virtual)
    return nn.Linear(DIM, DIM)


def _loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ((out - labels) ** 2).mean()


class Hooks:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.finals = 0
        self.flags: list[tuple[bool, bool]] = []  # (final, last_of_micro_batch) per backward

    def backward(self, run: Any, final: bool, last_of_micro_batch: bool = True) -> None:
        run()
        self.finals += int(final)
        self.flags.append((final, last_of_micro_batch))

    def reduce_tied_grads(self) -> None:
        self.calls.append("tied")

    def reduce_grads(self) -> None:
        self.calls.append("grads")

    def optimizer_step(self, losses: Any) -> None:
        self.calls.append("step")


class Counting:
    def __init__(self, items: list) -> None:
        self.items, self.reads = iter(items), 0

    def __iter__(self) -> Counting:
        return self

    def __next__(self) -> Any:
        self.reads += 1
        return next(self.items)


def _run_pipeline(
    name: str, p: int, m: int, v: int, *, train: bool = True
) -> tuple[list[Any], list[Chunks], list, list[int], list[Hooks]]:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, DIM, generator=g), torch.randn(2, DIM, generator=g)) for _ in range(m)]
    fabric = Fabric()
    modules = [Chunks(p, s, v) for s in range(p)]
    iters = [Counting(list(batches)) for _ in range(p)]
    hooks = [Hooks() for _ in range(p)]
    results: list[Any] = [None] * p

    def stage(s: int) -> None:
        try:
            executor = PipeExecutor(
                module=modules[s],
                channel=QueueChannel(fabric, s),
                pipe_ranks=range(p),
                stage_id=s,
                chunks=v,
                loss_fn=_loss,
            )
            data = StageData(
                iters[s],
                reads_inputs=s == 0,
                reads_labels=s == p - 1,
                device=torch.device("cpu"),
            )
            schedule = build_schedule(name, m, p, s, v, train=train)
            if train:
                result = executor.run(schedule.steps(), data, micro_batches=m, hooks=hooks[s])
            else:
                with torch.no_grad():
                    result = executor.run(schedule.steps(), data, micro_batches=m, keep_outputs=True)
            results[s] = (result, schedule.num_pipe_buffers())
        except BaseException as err:  # reported by the main thread
            results[s] = err

    threads = [threading.Thread(target=stage, args=(s,)) for s in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results, modules, batches, [it.reads for it in iters], hooks


def _reference_grads(p: int, v: int, batches: list) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    layers = [_layer(k) for k in range(p * v)]
    for x, y in batches:
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        (_loss(h, y) / len(batches)).backward()
    return {k: (layer.weight.grad, layer.bias.grad) for k, layer in enumerate(layers)}


CASES = [("gpipe", p, m, 1) for p in (1, 2, 3) for m in (1, 2, 5)]
CASES += [("1f1b", p, m, 1) for p in (1, 2, 4) for m in (1, 3, 6)]
CASES += [("interleaved", p, m, 2) for p, m in ((2, 2), (2, 4), (3, 6))]


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_executor_matches_sequential_backward(name: str, p: int, m: int, v: int) -> None:
    results, modules, batches, reads, hooks = _run_pipeline(name, p, m, v)
    expected = _reference_grads(p, v, batches)
    for s, module in enumerate(modules):
        for c, layer in enumerate(module.layers):
            w, b = expected[c * p + s]
            torch.testing.assert_close(layer.weight.grad, w, rtol=0, atol=1e-6)
            torch.testing.assert_close(layer.bias.grad, b, rtol=0, atol=1e-6)
    assert reads == [m if s in (0, p - 1) else 0 for s in range(p)]
    last, _ = results[-1]
    ref_losses = [float(_loss(_forward_all(p, v, x), y)) for x, y in batches]
    assert [float(t) for t in last.losses] == pytest.approx(ref_losses, abs=1e-6)
    for s, ((result, buffers), h) in enumerate(zip(results, hooks, strict=True)):
        assert h.calls == ["tied", "grads", "step"] and h.finals == 1
        # one "last chunk backward" per micro-batch (per-micro-batch reduction communicates there), the final
        # backward among them
        assert sum(last for _, last in h.flags) == m and h.flags[-1] == (True, True)
        assert result.stats.forwards == result.stats.backwards == m * v
        assert result.stats.peak_buffers <= buffers
        if name == "1f1b":
            assert result.stats.peak_buffers == min(p - s, m)
        if name == "gpipe":
            assert result.stats.peak_buffers == m


def _forward_all(p: int, v: int, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for k in range(p * v):
            x = torch.tanh(_layer(k)(x))
    return x


@pytest.mark.parametrize(("p", "m", "v"), [(1, 3, 1), (2, 1, 1), (3, 5, 1), (2, 4, 2), (3, 3, 2)])
def test_inference_schedule_outputs_and_losses(p: int, m: int, v: int) -> None:
    results, modules, batches, reads, hooks = _run_pipeline("1f1b", p, m, v, train=False)
    last, _ = results[-1]
    for (x, y), out, loss in zip(batches, last.outputs, last.losses, strict=True):
        expected = _forward_all(p, v, x)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        assert float(loss) == pytest.approx(float(_loss(expected, y)), abs=1e-6)
    assert reads == [m if s in (0, p - 1) else 0 for s in range(p)]
    assert all(h.calls == [] for h in hooks)
    assert all(layer.weight.grad is None for module in modules for layer in module.layers)


def test_buffers_refuse_a_slot_still_in_use() -> None:
    buffers = PipeBuffers()
    slot = buffers.claim(0, 1, micro_batch=3)
    buffers.mark_forwarded(slot)
    with pytest.raises(RuntimeError, match="buffer 1 of chunk 0 still holds micro-batch 3 when micro-batch 4"):
        buffers.claim(0, 1, micro_batch=4)
    buffers.free(0, 1)
    assert buffers.live == 0 and buffers.peak == 1
    buffers.claim(0, 1, micro_batch=4)


def test_stage_data_reads_pairs_and_names_bad_batches() -> None:
    data = StageData(
        iter([(torch.ones(2), torch.zeros(2)), [torch.ones(1)]]),
        reads_inputs=True,
        reads_labels=False,
        device=torch.device("cpu"),
        cast_dtype=torch.float16,
    )
    inputs, labels = data.load(0)
    assert inputs.dtype == torch.float16 and labels is None  # fp16.auto_cast: float inputs in the compute dtype
    with pytest.raises(TypeError, match=r"\(inputs, labels\) pairs.*list of length 1"):
        data.load(1)
    with pytest.raises(StopIteration, match="ran out at micro-batch 2"):
        data.load(2)
    assert as_tuple(torch.ones(1), "x")[1] is True
    with pytest.raises(TypeError, match="the output of stage 0 must be a tensor or a non-empty tuple"):
        as_tuple([torch.ones(1), None], "the output of stage 0")


def test_one_stage_pipeline_engine_without_a_process_group() -> None:
    """``initialize(model=PipelineModule(num_stages=1))`` in a lone process (no process group): a pipeline engine
    with no peers trains like plain torch (the schedule is its own first and last stage)."""
    import shardspeed
    from shardspeed.pipe import LayerSpec, PipelineModule

    def layers() -> list:
        return [LayerSpec(nn.Linear, DIM, DIM), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, DIM, DIM)]

    module = PipelineModule(layers(), num_stages=1, loss_fn=_loss, seed_layers=True)
    reference = PipelineModule(layers(), num_stages=1, loss_fn=_loss, seed_layers=True)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=module, config=config)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, DIM, generator=g), torch.randn(2, DIM, generator=g)) for _ in range(6)]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    try:
        for step in range(2):
            window = batches[3 * step : 3 * step + 3]
            loss = engine.train_batch(iter(window))
            optimizer.zero_grad()
            expected = sum(_loss(reference(x), y) / 3 for x, y in window)
            expected.backward()
            optimizer.step()
            assert float(loss) == pytest.approx(float(expected.detach()), abs=1e-6)
        for (name, p), q in zip(engine.module.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
        assert engine.global_steps == 2 and engine.pipe_stats.messages == 0
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ({"bf16": {"enabled": True}}, torch.float32),
        ({"fp16": {"enabled": True}}, torch.float32),
        ({"fp16": {"enabled": True, "auto_cast": True}}, torch.float16),
    ],
)
def test_first_stage_casts_float_inputs_only_under_fp16_auto_cast(precision: dict, expected: torch.dtype) -> None:
    """As ``engine.forward``: the pipeline's first stage casts float inputs (a float mask here) to the compute dtype
    only under ``fp16.auto_cast``; integer tokens are never cast."""
    import shardspeed
    from shardspeed.pipe import LayerSpec, PipelineModule

    seen: list[tuple[torch.dtype, torch.dtype]] = []

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, DIM)

        def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            tokens, mask = inputs
            seen.append((tokens.dtype, mask.dtype))
            return self.embed(tokens) + mask.to(self.embed.weight.dtype).unsqueeze(-1)

    module = PipelineModule([LayerSpec(Embed), LayerSpec(nn.Linear, DIM, DIM)], num_stages=1, loss_fn=_loss)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 1000,
        **precision,
    }
    engine, *_ = shardspeed.initialize(model=module, config=config)
    try:
        tokens, mask = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.zeros(2, 3)
        engine.train_batch(iter([((tokens, mask), torch.zeros(2, 3, DIM))]))
        assert seen == [(torch.int64, expected)]
    finally:
        engine.destroy()
