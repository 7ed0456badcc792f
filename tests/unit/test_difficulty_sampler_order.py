"""The difficulty sampler's draw order ([Note: difficulty sampler order]): nothing repeats while eligible samples
not yet drawn remain, a ``single_cluster`` metric or a no-op difficulty change changes nothing, every sample once
per epoch at full difficulty also after a ramp, eligibility at the running maximum difficulty, and the checkpointed
consumed set (resume mid-ramp at another world size; changed metric files refused)."""

from __future__ import annotations

import numpy as np
import pytest

from shardspeed.data.analyzer.files import MetricIndex
from shardspeed.data.curriculum import CurriculumSchedule
from shardspeed.data.difficulty import MetricCurriculum
from shardspeed.data.difficulty_sampler import DifficultySampler


def _index(values: np.ndarray) -> MetricIndex:
    order = np.argsort(values, kind="stable")
    unique, counts = np.unique(values, return_counts=True)
    return MetricIndex(order.astype(np.int64), counts.astype(np.int64), unique.astype(np.int64))


def _linear(lo: int, hi: int, steps: int, step: int = 1) -> CurriculumSchedule:
    return CurriculumSchedule(lo, hi, "fixed_linear", total_curriculum_step=steps, difficulty_step=step)


def _sampler(metrics, n: int, *, mbs: int, gas: int = 1, world: int = 1, rank: int = 0, seed: int = 1):
    return DifficultySampler(
        tuple(metrics),
        n,
        micro_batch_size=mbs,
        gradient_accumulation_steps=gas,
        dp_rank=rank,
        dp_world_size=world,
        seed=seed,
    )


SINGLE = MetricCurriculum("seqlen_truncate", _linear(80, 2048, 1000, 8), "value", None)


def test_single_cluster_ramp_beside_full_percentile_covers_every_sample_once() -> None:
    """DeepSpeed's recipe (review E, p5): a ramping single_cluster metric must not disturb the epoch."""
    n = 240
    values = np.random.default_rng(0).integers(1, 101, size=n)
    rarity = MetricCurriculum("rarity", _linear(100, 100, 10), "percentile", _index(values))
    with_single = _sampler((rarity, SINGLE), n, mbs=12).global_batches(40)
    alone = _sampler((rarity,), n, mbs=12).global_batches(40)
    for epoch in (with_single[:20], with_single[20:]):
        assert sorted(np.concatenate(epoch).tolist()) == list(range(n))
    assert all(np.array_equal(a, b) for a, b in zip(with_single, alone, strict=True))


def test_no_repeat_while_unseen_eligible_samples_remain_and_ramp_then_epoch() -> None:
    n, batch = 2000, 16
    values = np.random.default_rng(0).integers(1, 101, size=n)
    metric = MetricCurriculum("m", _linear(50, 100, 50), "value", _index(values))  # changes every step
    batches = _sampler((metric,), n, mbs=batch).global_batches(n // batch)  # one epoch, ramp included
    for g, b in enumerate(batches):
        assert np.all(values[b] <= metric.schedule.difficulty_at(g + 1)), g
    assert sorted(np.concatenate(batches).tolist()) == list(range(n))  # every sample exactly once


def test_a_change_that_adds_no_sample_changes_nothing() -> None:
    n = 300
    values = np.random.default_rng(1).choice([10, 20, 30], size=n)
    stepping = MetricCurriculum("m", _linear(10, 30, 20), "value", _index(values))  # 11..19 add nothing
    fixed = MetricCurriculum("m", CurriculumSchedule(10, 30, "custom"), "value", _index(values))
    a = _sampler((stepping,), n, mbs=10)
    b = _sampler((fixed,), n, mbs=10)
    b.set_custom_curriculum_learning_schedule({"m": lambda s: [10, 20, 30][min(2, s // 10)]})
    got_a, got_b = a.global_batches(30), b.global_batches(30)
    same = [stepping.schedule.difficulty_at(s) // 10 == [10, 20, 30][min(2, s // 10)] // 10 for s in range(1, 31)]
    assert all(same)  # the same eligible sets at every step, by different difficulty values
    assert all(np.array_equal(x, y) for x, y in zip(got_a, got_b, strict=True))


def test_small_eligible_set_starts_new_rounds_and_eligibility_uses_the_running_max() -> None:
    n = 100
    values = np.arange(n) % 10
    metric = MetricCurriculum("m", CurriculumSchedule(1, 9, "custom"), "value", _index(values))
    sampler = _sampler((metric,), n, mbs=8)
    sampler.set_custom_curriculum_learning_schedule({"m": lambda s: 1 if s <= 3 else (5 if s == 4 else 3)})
    batches = sampler.global_batches(6)
    first = np.concatenate(batches[:3])  # 20 eligible samples, 24 drawn: one round of 20, then 4 of the next
    assert sorted(first[:20].tolist()) == sorted(np.flatnonzero(values <= 1).tolist())
    assert np.all(values[first] <= 1)
    later = np.concatenate(batches[4:])  # the schedule drops 5 -> 3: DeepSpeed's clusters never shrink
    assert np.any(values[later] > 3) and np.all(values[later] <= 5)


def test_resume_mid_ramp_at_another_world_size_and_refuse_changed_files() -> None:
    n = 480
    values = np.random.default_rng(2).integers(0, 50, size=n)
    metric = MetricCurriculum("m", _linear(5, 49, 30), "value", _index(values), "files/m_index_to_sample")
    reference = _sampler((metric,), n, mbs=24).global_batches(40)
    first = _sampler((metric,), n, mbs=6, gas=2, world=2)
    first.advance(13 * 2)
    state = first.state_dict()
    assert state["current_difficulties"] == {"m": metric.schedule.difficulty_at(14)}
    ranks = [_sampler((metric,), n, mbs=3, gas=2, world=4, rank=r) for r in range(4)]
    for s in ranks:
        s.load_state_dict(state)
    iters = [iter(s) for s in ranks]
    for g in range(13, 20):
        assert [x for _ in range(2) for it in iters for x in next(it)] == reference[g].tolist(), g
    edited = values.copy()
    edited[:2] = edited[1::-1] + 1
    other = MetricCurriculum("m", metric.schedule, "value", _index(edited), "files/m_index_to_sample")
    with pytest.raises(ValueError, match=r"'m'.*files/m_index_to_sample.*fingerprint"):
        _sampler((other,), n, mbs=24).load_state_dict(state)


def test_data_post_process_func_gets_the_delivered_batchs_difficulties(tmp_path) -> None:
    """DeepSpeed's ``engine.set_data_post_process_func``: a single_cluster ``seqlen_truncate`` metric cut by the hook
    to the difficulty of the very batch being delivered (also the first)."""
    import torch

    import shardspeed
    from shardspeed.data.analyzer import write_metric_files

    n, width = 64, 16
    files = write_metric_files(np.arange(n) % 8, tmp_path, "m")
    ramp = {"schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 2}}
    metrics = {
        "m": {
            "index_to_sample_path": str(files.index_to_sample),
            "index_to_metric_path": str(files.index_to_metric),
            "difficulty_type": "value",
            **{"min_difficulty": 7, "max_difficulty": 7, "schedule_type": "fixed_linear"},
            "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 1},
        },
        "seqlen_truncate": {
            "clustering_type": "single_cluster",
            "difficulty_type": "value",
            "min_difficulty": 4,
            "max_difficulty": width,
            **ramp,
        },
    }
    config = {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "data_efficiency": {"data_sampling": {"curriculum_learning": {"enabled": True, "curriculum_metrics": metrics}}},
    }
    data = torch.utils.data.TensorDataset(torch.randn(n, width))
    model = torch.nn.Linear(1, 1)
    engine, _, loader, _ = shardspeed.initialize(model=model, training_data=data, config=config)
    seen: list[int] = []

    def cut(batch, state):
        seen.append(state["current_difficulties"]["seqlen_truncate"])
        return [batch[0][:, : state["current_difficulties"]["seqlen_truncate"]]]

    engine.set_data_post_process_func(cut)
    it = iter(loader)
    schedule = CurriculumSchedule(4, width, "fixed_linear", total_curriculum_step=6, difficulty_step=2)
    for step in range(1, 9):
        for _ in range(2):
            (x,) = next(it)
            assert x.shape[1] == schedule.difficulty_at(step), step
            engine.backward(engine(x.reshape(-1, 1)).pow(2).mean())
            engine.step()
    assert seen == [schedule.difficulty_at(s) for s in range(1, 9) for _ in range(2)]
    engine.destroy()


def test_config_checks_only_what_deepspeed_reads() -> None:
    from shardspeed.config import ConfigError, load_config

    def load(data_efficiency: dict):
        return load_config({"train_batch_size": 4, "data_efficiency": data_efficiency}, dp_world_size=1)

    partial = {"m": {"difficulty_type": "value"}}  # incomplete, but the section is off: DeepSpeed reads none of it
    assert load({"data_sampling": {"curriculum_learning": {"curriculum_metrics": partial}}}).data_efficiency
    on = {"data_sampling": {"curriculum_learning": {"enabled": True, "curriculum_metrics": partial}}}
    with pytest.raises(ConfigError, match=r"curriculum_metrics\.m\.index_to_sample_path"):
        load(on)
    assert load({"data_routing": {"enabled": True, "random_ltd": {"enabled": False}}}).data_efficiency
    with pytest.raises(ConfigError, match=r"data_routing.*random-LTD"):
        load({"data_routing": {"random_ltd": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"data_sampling\.pin_memory.*dynamic-batching"):
        load({"data_sampling": {"pin_memory": True}})
