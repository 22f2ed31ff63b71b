"""Files and directories that appear whole or not at all.

Everything specforge writes for a later run to read (shards, manifests, checkpoints, exported
drafters, converted models, reports) is made under a temporary name beside its target and
renamed into place once complete, so that a reader, or a restart after a kill, finds the old
version or the new one, never half of one.  The temporary name is hidden and unique to the
process (two writers never share one); :func:`remove_leftovers` clears what a killed run left.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["file_problem", "file_record", "fsync", "remove_leftovers", "replace_atomically", "sha256_file",
           "temporary_path", "write_atomic"]

LEFTOVERS = ".*.tmp*"  # matches every temporary_path() in a directory


def temporary_path(target: str | os.PathLike) -> Path:
    """Where ``target`` is made before it is renamed: in its directory, because a rename is
    atomic only within one filesystem."""
    target = Path(target)
    return target.with_name(f".{target.name}.tmp{os.getpid()}")


def fsync(path: str | os.PathLike) -> None:
    """Flush a file's data, or a directory's entries (a rename is durable once its directory
    is flushed), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_leftovers(directory: str | os.PathLike, pattern: str = LEFTOVERS) -> None:
    """Delete the temporaries a killed run left in ``directory``: they are never complete."""
    for path in Path(directory).glob(pattern):
        _remove(path)


@contextmanager
def _discarded_unless_moved(tmp: Path) -> Iterator[Path]:
    _remove(tmp)  # a leftover of an earlier process with the same pid
    try:
        yield tmp
    finally:
        _remove(tmp)  # nothing left once it was renamed; a half-made one when the body raised


def _move_into_place(tmp: Path, target: Path) -> None:
    if tmp.is_dir() and target.is_dir():
        # rename(2) replaces a file or an empty directory only, so a directory that is there
        # is moved aside first: for a moment there is no ``target``, but never a half one.
        old = target.with_name(f".{target.name}.old{os.getpid()}")
        _remove(old)
        target.rename(old)
        try:
            tmp.rename(target)
        except BaseException:
            old.rename(target)
            raise
        _remove(old)
    else:
        os.replace(tmp, target)
    fsync(target.parent)


@contextmanager
def replace_atomically(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path; what the block makes there (a file or a directory) replaces
    ``target`` when the block returns, and is deleted if it raises.

    The rename is flushed to the disk; the files the block writes are flushed only if it calls
    :func:`fsync` on them.
    """
    target = Path(target)
    with _discarded_unless_moved(temporary_path(target)) as tmp:
        yield tmp
        _move_into_place(tmp, target)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, overwrite: bool = True) -> None:
    """Write ``data`` (a str as UTF-8) to ``path``, flushed to the disk before the rename.

    ``overwrite=False`` raises ``FileExistsError`` rather than replace a file that is there:
    the file is hard-linked into place, which is atomic and never replaces.
    """
    path = Path(path)
    with _discarded_unless_moved(temporary_path(path)) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            _move_into_place(tmp, path)
        else:
            _link_into_place(tmp, path)


def _link_into_place(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: check, then rename (not atomic)
        if path.exists():
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.replace(tmp, path)
    fsync(path.parent)


# -- integrity records: what a manifest says about a file, and what is wrong with it now ---------


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: str | os.PathLike) -> dict[str, int | str]:
    """``{"bytes", "sha256"}`` of a file, as manifests (checkpoints, drafters) record it."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}


def file_problem(path: str | os.PathLike, record: dict, manifest: str, name: str | None = None) -> str | None:
    """What is wrong with ``path`` against its ``record`` (from :func:`file_record`, kept in
    ``manifest``), in words naming the file (as ``name``, default its path); None when intact."""
    path = Path(path)
    name = name or str(path)
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size < record["bytes"]:
        return f"{name} is truncated ({size} of {record['bytes']} bytes)"
    if size != record["bytes"]:
        return f"{name} has {size} bytes, {manifest} says {record['bytes']}"
    if sha256_file(path) != record["sha256"]:
        return f"{name} is corrupt (its sha256 differs from the one recorded in {manifest})"
    return None
