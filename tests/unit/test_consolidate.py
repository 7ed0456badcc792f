"""zero-to-fp32 consolidation: state dicts equal the saved model, HF-style sharding, tied weights, strict
loading, and the CLI's errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from shardspeed.checkpoint.commit import commit_checkpoint, make_tmp_dir
from shardspeed.checkpoint.consolidate import main, parse_size
from shardspeed.checkpoint.store import CheckpointWriter
from shardspeed.launcher.cli import main as shardspeed_main
from shardspeed.utils import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint


class TinyLM(nn.Module):
    """Embedding tied to the output head, a layer norm and a persistent buffer: what consolidation must carry."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 6)
        self.ln = nn.LayerNorm(6)
        self.proj = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("position", torch.arange(5, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def save_model(save_dir: Path, model: nn.Module, tag: str = "global_step3", num_ranks: int = 2, **writer_args) -> Path:
    """Save ``model`` as ZeRO ranks would: each parameter's flat range split evenly over the ranks, in fp32
    (the master copy), buffers on rank 0, and the tied alias in the metadata."""
    tmp_dir = make_tmp_dir(save_dir, tag, "n")
    writers = [CheckpointWriter(tmp_dir, rank, **writer_args) for rank in range(num_ranks)]
    for name, parameter in model.named_parameters():
        flat = parameter.detach().float().reshape(-1)
        bounds = [flat.numel() * rank // num_ranks for rank in range(num_ranks + 1)]
        for rank, writer in enumerate(writers):
            writer.add(f"param/{name}", tuple(parameter.shape), bounds[rank], flat[bounds[rank] : bounds[rank + 1]])
    for name, buffer in model.state_dict().items():
        if name not in dict(model.named_parameters(remove_duplicate=False)):
            writers[0].add(f"buffer/{name}", tuple(buffer.shape), 0, buffer.reshape(-1))
    records = [record for writer in writers for record in writer.finish()]
    return commit_checkpoint(save_dir, tag, tmp_dir, records, {"tied": {"lm_head.weight": "wte.weight"}}, True)


@pytest.fixture
def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def test_fp32_state_dict_equals_the_model(tmp_path: Path, model: TinyLM) -> None:
    save_model(tmp_path, model, chunk_bytes=24)
    for source in (tmp_path, tmp_path / "global_step3"):  # the save dir (via latest) or the checkpoint itself
        state_dict = get_fp32_state_dict_from_zero_checkpoint(source)
        expected = model.state_dict()
        assert list(state_dict) != [] and set(state_dict) == set(expected)
        for name, value in expected.items():
            assert torch.equal(state_dict[name], value), name
            assert state_dict[name].dtype == (torch.int64 if name == "position" else torch.float32)
        assert state_dict["lm_head.weight"] is state_dict["wte.weight"]


def test_bf16_stored_parameters_come_out_fp32(tmp_path: Path) -> None:
    values = torch.randn(4, 5).to(torch.bfloat16)
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    writer = CheckpointWriter(tmp_dir, 0, chunk_bytes=6)
    writer.add("param/w", (4, 5), 0, values.reshape(-1))
    commit_checkpoint(tmp_path, "t", tmp_dir, writer.finish(), {}, True)
    assert main([str(tmp_path), str(tmp_path / "out.safetensors")]) == 0
    loaded = load_file(tmp_path / "out.safetensors")
    assert loaded["w"].dtype == torch.float32 and torch.equal(loaded["w"], values.float())


def test_cli_single_file_output_with_tied_weights_listed(tmp_path: Path, model: TinyLM) -> None:
    save_model(tmp_path / "ckpt", model)
    assert shardspeed_main(["zero-to-fp32", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--safetensors"]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(loaded) == set(expected)
    assert all(torch.equal(loaded[name], value) for name, value in expected.items())
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        assert json.loads(handle.metadata()["tied_weights"]) == {"lm_head.weight": "wte.weight"}


def test_sharding_by_max_size_follows_hf_layout(tmp_path: Path) -> None:
    sizes = {"a": 30, "b": 30, "c": 100, "d": 10, "e": 50}  # elements; fp32 bytes are 4x
    tensors = {name: torch.randn(numel) for name, numel in sizes.items()}
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    writer = CheckpointWriter(tmp_dir, 0, chunk_bytes=64)
    for name, tensor in tensors.items():
        writer.add(f"param/{name}", (tensor.numel(),), 0, tensor)
    commit_checkpoint(tmp_path, "t", tmp_dir, writer.finish(), {}, True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"stale single file of an earlier export")
    # 300 bytes per shard, in order: [a, b] = 240; c = 400 alone (too big for any shard); [d, e] = 240.
    assert main([str(tmp_path), str(out), "--max-shard-size", "300B"]) == 0
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(os.listdir(out)) == sorted([*names, "model.safetensors.index.json"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 4 * sum(sizes.values())
    assert index["weight_map"] == {"a": names[0], "b": names[0], "c": names[1], "d": names[2], "e": names[2]}
    for file_name in names:
        for key, value in load_file(out / file_name).items():
            assert index["weight_map"][key] == file_name and torch.equal(value, tensors[key])
    assert main([str(tmp_path), str(out)]) == 0  # re-export unsharded: the old shards must go
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_load_state_dict_from_zero_checkpoint_is_strict_and_converts(tmp_path: Path, model: TinyLM) -> None:
    save_model(tmp_path, model, num_ranks=3)
    torch.manual_seed(1)
    fresh = TinyLM().to(torch.bfloat16)
    assert load_state_dict_from_zero_checkpoint(fresh, tmp_path) is fresh
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value.to(fresh.state_dict()[name].dtype)), name
    assert fresh.lm_head.weight is fresh.wte.weight

    class Wider(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 7)
            self.extra = nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match=r"missing keys \['extra.weight', 'extra.bias'\].*proj.weight: checkpoint"):
        load_state_dict_from_zero_checkpoint(Wider(), tmp_path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5GB", 5 * 10**9), ("256MB", 256 * 10**6), ("500MiB", 500 * 2**20), ("1.5gb", 1_500_000_000), ("123", 123)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_cli_errors(tmp_path: Path, model: TinyLM, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-dir"
    assert main([str(missing), str(tmp_path / "out")]) == 1
    assert f"checkpoint directory {missing} does not exist" in capsys.readouterr().err
    assert main([str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "5 parsecs"]) == 2
    assert "--max-shard-size: size '5 parsecs' is not valid" in capsys.readouterr().err
    save_model(tmp_path, model)
    assert main([str(tmp_path), str(tmp_path / "pytorch_model.bin")]) == 1
    assert "writes safetensors only" in capsys.readouterr().err
    assert main([str(tmp_path), str(tmp_path / "out"), "--tag", "global_step4"]) == 1
    assert "tag 'global_step4'" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main([]) == 2
    assert "required" in capsys.readouterr().err
    assert shardspeed_main(["help", "zero-to-fp32"]) == 0
    assert "--max-shard-size" in capsys.readouterr().out
