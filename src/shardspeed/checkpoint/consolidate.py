"""``shardspeed zero-to-fp32``: turn a checkpoint (any stage, any world size) into an fp32 model state dict.

    shardspeed zero-to-fp32 CHECKPOINT_DIR OUTPUT [--tag T] [--max-shard-size 5GB] [--safetensors]

The output is always safetensors (no pickle to write, none to load): ``OUTPUT`` is a directory receiving
``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards plus Hugging Face's
``model.safetensors.index.json`` when the model exceeds ``--max-shard-size``; an ``OUTPUT`` ending in
``.safetensors`` is one file, unsharded. ``--safetensors`` (DeepSpeed's ``--safe_serialization``) is accepted
and changes nothing; DeepSpeed's ``pytorch_model.bin`` output is deliberately not offered.

Exported: every ``param/<name>`` entry as fp32 under ``<name>``, and every ``buffer/<name>`` entry in its stored
dtype. Tied aliases (``metadata["tied"] = {alias: target}``) are not written as tensors — safetensors refuses
shared storage and a copy would double their memory; they are listed as ``tied_weights`` in the index metadata
(or the single file's ``__metadata__``), and Hugging Face loaders re-tie them. The in-memory functions
(``get_fp32_state_dict_from_zero_checkpoint`` and ``load_state_dict_from_zero_checkpoint``) include them.

Tensor-parallel checkpoints hold each sliced tensor as boxes of its global shape; the reader assembles the global
flat order from them block by block (``box_io.read_sliced_range``), so the output is the state dict a
single-process model loads, at any tensor-parallel degree the checkpoint was saved with.

Memory: the file header needs only shapes, so each output file is written as a stream of checkpoint chunks
(read, checksum-verified, converted to fp32, written, dropped): the peak is about one chunk (64 MiB by default),
less than the largest output shard, and never the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

import torch

from shardspeed.checkpoint.index import INDEX_FILE, CheckpointError
from shardspeed.checkpoint.safetensors_file import SafetensorsStreamWriter
from shardspeed.checkpoint.store import CheckpointReader, resolve_tag

PROGRAM = "shardspeed zero-to-fp32"
PARAM_PREFIX = "param/"
BUFFER_PREFIX = "buffer/"
SINGLE_FILE = "model.safetensors"
SHARD_INDEX_FILE = "model.safetensors.index.json"
_OUR_OUTPUT_NAMES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
# Hugging Face's convention: KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2.
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``5GB`` (5·10⁹), ``500MiB`` (500·2²⁰), ``1.5GB`` or ``1000000``."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = Decimal(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).upper() if match else ""
        if not match or unit not in _SIZE_UNITS:
            raise ValueError(
                f"size {text!r} is not valid; write a number of bytes or a number with a unit: "
                "KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 5GB"
            )
        try:
            value = Decimal(match.group(1)) * _SIZE_UNITS[unit]
        except InvalidOperation:
            raise ValueError(f"size {text!r} is not a number") from None
    if value < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return int(value)


@dataclass(frozen=True)
class ExportedTensor:
    """One tensor of the output: its output name, checkpoint entry, shape and output dtype."""

    name: str
    entry: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


def open_checkpoint(checkpoint_dir: str | Path, tag: str | None = None) -> CheckpointReader:
    """A reader for ``checkpoint_dir/<tag>`` (``latest`` when tag is None), or for ``checkpoint_dir`` itself
    when it is a checkpoint (holds ``index.json``) and no tag is given."""
    checkpoint_dir = Path(checkpoint_dir)
    if tag is None and (checkpoint_dir / INDEX_FILE).is_file():
        return CheckpointReader(checkpoint_dir)
    return CheckpointReader(checkpoint_dir / resolve_tag(checkpoint_dir, tag))


def exported_tensors(reader: CheckpointReader) -> list[ExportedTensor]:
    """The model state of a checkpoint in index order: parameters as fp32, buffers in their stored dtype."""
    exported: dict[str, ExportedTensor] = {}
    for entry in reader.names():
        if entry.startswith(PARAM_PREFIX):
            name, dtype = entry[len(PARAM_PREFIX) :], torch.float32
        elif entry.startswith(BUFFER_PREFIX):
            name, dtype = entry[len(BUFFER_PREFIX) :], reader.dtype(entry)
        else:
            continue
        if name in exported:
            raise CheckpointError(f"checkpoint {reader.ckpt_dir}: {name!r} is stored both as a parameter and a buffer")
        exported[name] = ExportedTensor(name=name, entry=entry, shape=reader.shape(entry), dtype=dtype)
    if not exported:
        raise CheckpointError(f"checkpoint {reader.ckpt_dir} holds no model tensors ('{PARAM_PREFIX}*' entries)")
    return list(exported.values())


def tied_aliases(reader: CheckpointReader, exported: list[ExportedTensor]) -> dict[str, str]:
    """``metadata["tied"]`` validated: alias → target, where the target is exported and the alias is not."""
    tied = reader.metadata.get("tied") or {}
    names = {tensor.name for tensor in exported}
    where = f"checkpoint {reader.ckpt_dir}: metadata['tied']"
    if not isinstance(tied, dict):
        raise CheckpointError(f"{where} must map alias names to parameter names, got {tied!r}")
    aliases = {}
    for alias, target in tied.items():
        if not isinstance(target, str) or target not in names:
            raise CheckpointError(f"{where}[{alias!r}] = {target!r} is not a parameter of the checkpoint")
        if alias not in names:  # an alias stored as a tensor of its own needs no aliasing
            aliases[alias] = target
    return aliases


def plan_shards(tensors: list[ExportedTensor], max_shard_bytes: int) -> list[list[ExportedTensor]]:
    """Split ``tensors`` in order into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[ExportedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def _write_file(reader: CheckpointReader, path: Path, tensors: list[ExportedTensor], metadata: dict[str, str]) -> None:
    """Stream ``tensors`` into the safetensors file ``path`` (via ``path.partial``, renamed when complete)."""
    ordered = sorted(tensors, key=lambda tensor: -torch.empty((), dtype=tensor.dtype).element_size())
    partial = path.with_name(path.name + ".partial")
    writer = SafetensorsStreamWriter(partial, [(t.name, t.dtype, t.shape) for t in ordered], metadata)
    try:
        for tensor in ordered:
            for _, piece in reader.iter_range(tensor.entry, 0, reader.numel(tensor.entry), tensor.dtype):
                writer.write(tensor.name, piece)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    os.replace(partial, path)


def write_fp32_checkpoint(reader: CheckpointReader, output: Path, max_shard_bytes: int) -> list[Path]:
    """Write the checkpoint's model state to ``output`` (see the module docstring); returns the files written."""
    output = Path(output)
    tensors = exported_tensors(reader)
    aliases = tied_aliases(reader, tensors)
    file_metadata = {"format": "pt"} | ({"tied_weights": json.dumps(aliases)} if aliases else {})
    if output.suffix in (".bin", ".pt", ".pth"):
        raise CheckpointError(
            f"OUTPUT {output} asks for a pickle file; {PROGRAM} writes safetensors only: give an output directory "
            "or a path ending in .safetensors"
        )
    if output.suffix == ".safetensors":
        output.parent.mkdir(parents=True, exist_ok=True)
        _write_file(reader, output, tensors, file_metadata)
        return [output]
    output.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        written = [output / SINGLE_FILE]
        _write_file(reader, written[0], tensors, file_metadata)
    else:
        written = [output / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for path, shard in zip(written, shards):
            _write_file(reader, path, shard, {"format": "pt"})
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)} | ({"tied_weights": aliases} if aliases else {}),
            "weight_map": {tensor.name: path.name for path, shard in zip(written, shards) for tensor in shard},
        }
        (output / SHARD_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        written.append(output / SHARD_INDEX_FILE)
    for stale in output.iterdir():  # shards of an earlier, differently sharded export would mislead loaders
        if _OUR_OUTPUT_NAMES.fullmatch(stale.name) and stale not in written:
            stale.unlink()
    return written


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | Path, output: str | Path, tag: str | None = None, max_shard_size: str | int = "5GB"
) -> list[Path]:
    """The library form of ``shardspeed zero-to-fp32``; returns the files written."""
    max_shard_bytes = parse_size(max_shard_size)
    with open_checkpoint(checkpoint_dir, tag) as reader:
        return write_fp32_checkpoint(reader, Path(output), max_shard_bytes)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None) -> dict:
    """The fp32 model state dict of a checkpoint (tied aliases share their target's tensor), in CPU memory.

    ``checkpoint_dir`` is the save directory (``tag`` or ``latest`` selects the checkpoint) or a checkpoint itself.
    """
    with open_checkpoint(checkpoint_dir, tag) as reader:
        tensors = exported_tensors(reader)
        state_dict = {tensor.name: reader.read_full(tensor.entry, tensor.dtype) for tensor in tensors}
        for alias, target in tied_aliases(reader, tensors).items():
            state_dict[alias] = state_dict[target]
    return state_dict


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | Path, tag: str | None = None
) -> torch.nn.Module:
    """Copy a checkpoint's fp32 model state into ``model`` (strict: same keys and shapes), one tensor at a time.

    Values are read straight into the model's tensors (converted to their dtype, on their device), so no second
    copy of the model is built. Module ``_load_from_state_dict`` hooks are not called. Returns ``model``.
    """
    with open_checkpoint(checkpoint_dir, tag) as reader:
        tensors = exported_tensors(reader)
        sources = {tensor.name: tensor for tensor in tensors}
        for alias, target in tied_aliases(reader, tensors).items():
            sources[alias] = sources[target]
        targets = model.state_dict(keep_vars=True)
        non_persistent = {name for name, _ in model.named_buffers()} - set(targets)
        missing = [name for name in targets if name not in sources]
        unexpected = [name for name in sources if name not in targets and name not in non_persistent]
        mismatched = [
            f"{name}: checkpoint {list(sources[name].shape)}, model {list(value.shape)}"
            for name, value in targets.items()
            if name in sources and tuple(value.shape) != sources[name].shape
        ]
        if missing or unexpected or mismatched:
            raise RuntimeError(
                f"checkpoint {reader.ckpt_dir} does not match {type(model).__name__} (strict load): "
                f"missing keys {missing}, unexpected keys {unexpected}, shape mismatches {mismatched}"
            )
        with torch.no_grad():
            for name, value in targets.items():
                data = value.data
                if data.is_contiguous():
                    reader.read_range_into(sources[name].entry, 0, data.view(-1))
                else:
                    data.copy_(reader.read_full(sources[name].entry).view(data.shape))
    return model


def _rss_anon_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no RssAnon line (Linux only)")


class _PeakRssSampler(threading.Thread):
    """Samples this process's RssAnon every millisecond (hidden ``--report-rss``, used by the memory test)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib = _rss_anon_kib()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.001):
            self.peak_kib = max(self.peak_kib, _rss_anon_kib())


def build_parser() -> argparse.ArgumentParser:
    """The ``shardspeed zero-to-fp32`` argument parser (DeepSpeed's underscore spellings are accepted too)."""
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="Write the fp32 model weights of a shardspeed checkpoint (any ZeRO stage, any world size) as "
        "safetensors, streaming: memory stays around one checkpoint chunk.",
        allow_abbrev=False,
    )
    parser.add_argument("checkpoint_dir", help="the save directory (holding 'latest') or one checkpoint directory")
    parser.add_argument("output", help="output directory, or a single file path ending in .safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag to convert (default: the 'latest' file)")
    parser.add_argument(
        "--max-shard-size",
        "--max_shard_size",
        default="5GB",
        help="split the output into shards of at most this size (default 5GB; units KB/MB/GB or KiB/MiB/GiB)",
    )
    parser.add_argument(
        "--safetensors",
        "--safe_serialization",
        action="store_true",
        help="accepted for DeepSpeed compatibility: output is always safetensors",
    )
    parser.add_argument("--report-rss", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``shardspeed zero-to-fp32``; 0 on success, 2 for bad arguments, 1 for an unusable checkpoint."""
    try:
        options = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_request:  # --help (0) or a usage error (2, already printed by argparse)
        code = exit_request.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    try:
        max_shard_bytes = parse_size(options.max_shard_size)
    except ValueError as error:
        print(f"{PROGRAM}: error: --max-shard-size: {error}", file=sys.stderr)
        return 2
    sampler = _PeakRssSampler() if options.report_rss else None
    if sampler is not None:
        print(f"rss-anon-baseline-kib: {sampler.peak_kib}", file=sys.stderr, flush=True)
        sampler.start()
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(
            options.checkpoint_dir, options.output, options.tag, max_shard_bytes
        )
    except (CheckpointError, OSError) as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return 1
    finally:
        if sampler is not None:
            sampler.stopped.set()
            sampler.join()
            print(f"rss-anon-peak-kib: {sampler.peak_kib}", file=sys.stderr, flush=True)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
