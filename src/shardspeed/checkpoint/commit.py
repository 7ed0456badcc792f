"""Crash-safe commit of a checkpoint directory, the ``latest`` file, and finding the tag to load.

Layout of a save directory::

    save_dir/latest                  the newest committed tag, as plain text (DeepSpeed's format)
    save_dir/<tag>/index.json        tensor index (see index.py); its presence marks a committed checkpoint
    save_dir/<tag>/metadata.json     the caller's plain-data metadata
    save_dir/<tag>/rank*-*.safetensors
    save_dir/.tmp-<tag>-<nonce>/     a save in progress (or one killed mid-way): never loaded
    save_dir/.old-<tag>-<nonce>/     the previous copy of <tag> while a save of the same tag replaces it

Commit order (one rank, after every rank's ``CheckpointWriter.finish``): validate the tiling, write + fsync
``index.json`` and ``metadata.json`` into the temporary directory, fsync it, rename it to ``<tag>``, fsync
``save_dir``, and only then replace ``latest`` (write ``latest.tmp``, fsync, rename, fsync ``save_dir``). A
process killed at any point therefore leaves ``latest`` naming a complete checkpoint: before the rename the new
data sits in an ignored ``.tmp-*`` directory; after it, the new tag is complete but not yet ``latest``.

Saving a tag that already exists: the old ``<tag>`` is first renamed to ``.old-<tag>-<nonce>``, the new one
renamed into place, then the old copy deleted. A crash between those two renames leaves no ``<tag>`` but a
complete ``.old-*`` copy, which ``resolve_tag`` points out in its error; ``cleanup_stale_tmp`` removes leftovers.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardspeed.checkpoint.index import (
    INDEX_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointNotFoundError,
    build_index,
    dumps,
    index_to_json,
    metadata_to_json,
)
from shardspeed.faults.inject import maybe_fail

LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
_RESERVED_NAMES = (LATEST_FILE, f"{LATEST_FILE}.tmp")


def fsync_directory(path: Path) -> None:
    """fsync a directory so that the entries created or renamed in it survive a power loss."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_text_durably(path: Path, text: str) -> None:
    """Write ``path`` and fsync it (the directory entry is made durable by the caller's directory fsync)."""
    try:
        maybe_fail("checkpoint_write", path)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror or str(error), str(path)) from error  # a full disk names no file


def validate_tag(tag: Any) -> str:
    """A tag names one directory inside the save directory: no separators, no leading dot, not empty."""
    if not isinstance(tag, str) or not tag.strip():
        raise CheckpointError(f"checkpoint tag must be a non-empty string, got {tag!r}")
    if "/" in tag or "\\" in tag or tag.startswith(".") or tag != tag.strip() or "\n" in tag or tag in _RESERVED_NAMES:
        raise CheckpointError(
            f"checkpoint tag {tag!r} is invalid: it must be a single directory name without '/', leading '.' or "
            f"surrounding whitespace, other than {' and '.join(map(repr, _RESERVED_NAMES))} (e.g. 'global_step100')"
        )
    return tag


def make_tmp_dir(save_dir: Path, tag: str, nonce: str) -> Path:
    """Create (idempotently: every rank may call it) ``save_dir/.tmp-<tag>-<nonce>`` and return it.

    ``nonce`` must be the same on all ranks and unique per save (e.g. rank 0's ``uuid4().hex``, broadcast).
    """
    validate_tag(tag)
    if not isinstance(nonce, str) or not nonce or "/" in nonce:
        raise CheckpointError(f"nonce must be a non-empty string without '/', got {nonce!r}")
    tmp_dir = Path(save_dir) / f"{TMP_PREFIX}{tag}-{nonce}"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    return tmp_dir


def _check_files_present(tmp_dir: Path, records: Sequence[Mapping[str, Any]]) -> None:
    files = {record["file"] for record in records if record.get("file") is not None}
    missing = sorted(file for file in files if not (tmp_dir / file).is_file())
    if missing:
        raise CheckpointError(
            f"cannot commit {tmp_dir}: data files {missing[:5]} named by the chunk records are not there "
            "(did every rank write into this same directory, and call CheckpointWriter.finish() before the commit?)"
        )


def commit_checkpoint(
    save_dir: Path,
    tag: str,
    tmp_dir: Path,
    records: Sequence[Mapping[str, Any]],
    metadata: Mapping[str, Any],
    save_latest: bool = True,
) -> Path:
    """Publish ``tmp_dir`` as ``save_dir/<tag>`` (see the module docstring for the order); returns that path.

    ``records`` is the concatenation of every rank's ``CheckpointWriter.finish()``; ``metadata`` must be plain
    JSON data. Run on one rank, after all ranks finished writing.
    """
    save_dir, tmp_dir = Path(save_dir), Path(tmp_dir)
    validate_tag(tag)
    if tmp_dir.parent.resolve() != save_dir.resolve() or not tmp_dir.name.startswith(f"{TMP_PREFIX}{tag}-"):
        raise CheckpointError(
            f"tmp_dir {tmp_dir} must be the directory make_tmp_dir(save_dir, {tag!r}, nonce) returned, inside "
            f"{save_dir} (the rename into place must stay on one file system)"
        )
    if not tmp_dir.is_dir():
        raise CheckpointNotFoundError(f"cannot commit: temporary checkpoint directory {tmp_dir} does not exist")
    index = index_to_json(build_index(records))  # raises, naming the tensor, on gaps/overlaps
    metadata_document = metadata_to_json(metadata)
    _check_files_present(tmp_dir, records)
    write_text_durably(tmp_dir / INDEX_FILE, dumps(index))
    write_text_durably(tmp_dir / METADATA_FILE, dumps(metadata_document))
    fsync_directory(tmp_dir)

    final_dir = save_dir / tag
    aside = save_dir / f"{OLD_PREFIX}{tmp_dir.name[len(TMP_PREFIX) :]}"
    replaced = final_dir.exists()
    if replaced:
        os.rename(final_dir, aside)
    os.rename(tmp_dir, final_dir)
    fsync_directory(save_dir)
    if replaced:
        shutil.rmtree(aside, ignore_errors=True)
    _remove_killed_saves_of(save_dir, tag)
    if save_latest:
        try:
            write_latest(save_dir, tag)
        except OSError as error:
            (save_dir / f"{LATEST_FILE}.tmp").unlink(missing_ok=True)
            previous = read_latest(save_dir)
            raise OSError(
                error.errno,
                f"checkpoint {final_dir} is complete, but '{LATEST_FILE}' could not be updated and still names "
                f"{previous!r}: {error}",
            ) from error
    return final_dir


def discard_tmp(save_dir: Path, tag: str, nonce: str) -> None:
    """Remove the temporary directory of a save that failed on some rank (nothing of it was committed)."""
    shutil.rmtree(Path(save_dir) / f"{TMP_PREFIX}{tag}-{nonce}", ignore_errors=True)


def _remove_killed_saves_of(save_dir: Path, tag: str) -> None:
    """After ``tag`` was committed, remove the ``.tmp-<tag>-*`` directories left by earlier saves of the same tag
    that were killed (a resumed run saving the step it died at); other tags' leftovers go after a day
    (``cleanup_stale_tmp``), since another job could be writing them."""
    killed = re.compile(re.escape(f"{TMP_PREFIX}{tag}-") + "[0-9a-f]{32}")  # the engine's nonces: uuid4().hex
    for child in Path(save_dir).iterdir():
        if killed.fullmatch(child.name) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
    cleanup_stale_tmp(save_dir)


def write_latest(save_dir: Path, tag: str) -> None:
    """Atomically make ``save_dir/latest`` name ``tag``: write ``latest.tmp``, fsync, rename, fsync the dir."""
    validate_tag(tag)
    staging = Path(save_dir) / f"{LATEST_FILE}.tmp"
    write_text_durably(staging, tag)
    os.replace(staging, Path(save_dir) / LATEST_FILE)
    fsync_directory(Path(save_dir))


def read_latest(save_dir: Path) -> str | None:
    """The tag named by ``save_dir/latest``, or None when there is no ``latest`` file."""
    path = Path(save_dir) / LATEST_FILE
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
    if not text:
        raise CheckpointError(f"{path} is empty; it should contain the tag of the newest checkpoint")
    return text


def list_tags(save_dir: Path) -> list[str]:
    """Committed tags in ``save_dir`` (directories holding an ``index.json``), oldest first by commit time."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    committed = [
        child
        for child in save_dir.iterdir()
        if not child.name.startswith(".") and child.is_dir() and (child / INDEX_FILE).is_file()
    ]
    return [child.name for child in sorted(committed, key=lambda child: ((child / INDEX_FILE).stat().st_mtime, child))]


def resolve_tag(load_dir: Path, tag: str | None) -> str:
    """The tag to load from ``load_dir``: ``tag`` itself, or the one named by ``latest`` when ``tag`` is None.

    Errors (``CheckpointNotFoundError``) name the directory, say what is missing, and list the committed tags.
    Uncommitted ``.tmp-*`` directories are never candidates.
    """
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {load_dir} does not exist")
    available = list_tags(load_dir)
    listing = f"committed tags: {', '.join(available)}" if available else "it holds no committed checkpoint"
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            raise CheckpointNotFoundError(
                f"no '{LATEST_FILE}' file in {load_dir}, so the tag to load is unknown; pass a tag explicitly "
                f"({listing})"
            )
        try:
            validate_tag(tag)  # e.g. a hand-written '.tmp-...' must not make an uncommitted save loadable
        except CheckpointError as error:
            raise CheckpointError(f"{load_dir / LATEST_FILE}: {error}") from None
        source = f"'{LATEST_FILE}' names tag {tag!r}, but"
    else:
        validate_tag(tag)
        source = f"tag {tag!r}:"
    if not (load_dir / tag / INDEX_FILE).is_file():
        state = "has no index.json (not a committed checkpoint)" if (load_dir / tag).is_dir() else "does not exist"
        leftovers = sorted(load_dir.glob(f"{OLD_PREFIX}{tag}-*"))
        hint = (
            f"; a previous copy interrupted while being replaced is at {leftovers[-1]} — rename it to "
            f"{load_dir / tag} to use it"
            if leftovers
            else ""
        )
        raise CheckpointNotFoundError(f"{source} {load_dir / tag} {state} ({listing}){hint}")
    return tag


def _newest_mtime(path: Path) -> float:
    """The newest modification time of a directory and its direct entries (files still being written count)."""
    newest = path.stat().st_mtime
    for child in path.iterdir():
        try:
            newest = max(newest, child.stat().st_mtime)
        except FileNotFoundError:  # deleted meanwhile
            continue
    return newest


def cleanup_stale_tmp(save_dir: Path, min_age_s: float = 24 * 3600.0, now: float | None = None) -> list[Path]:
    """Delete ``.tmp-*`` (killed saves) and ``.old-*`` directories untouched for at least ``min_age_s`` seconds.

    The age guard keeps a save that another job is writing right now; pass ``min_age_s=0`` to remove every
    leftover when you know no save is running. Returns the removed paths.
    """
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    now = time.time() if now is None else now
    removed = []
    for child in sorted(save_dir.iterdir()):
        if not child.is_dir() or not child.name.startswith((TMP_PREFIX, OLD_PREFIX)):
            continue
        if now - _newest_mtime(child) >= min_age_s:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed
