"""The folder mechanics of a training checkpoint: written whole or not at all, verified on load.

:func:`staged_folder` (collective under torch.distributed) is how a checkpoint is written: every
file goes into a staging folder beside the target, ``.<name>.saving``; once every rank has written
its files, the ranks checksum them (SHA-256, each rank a share of the files), rank 0 writes
``manifest.json`` (each file's size and SHA-256), syncs the folder to disk and puts it in place with
one atomic ``renameat2(RENAME_EXCHANGE)`` over an existing checkpoint (a plain ``rename`` when
there is none), then removes the previous checkpoint. A process killed at any point therefore
leaves the target either the previous complete checkpoint or the new complete one, plus at worst a
stale ``.<name>.saving`` folder, which the next save of that target removes. Where the filesystem
cannot exchange two folders, the previous checkpoint is first renamed to ``.<name>.replaced``;
:func:`loadable_folder` reads it from there if a kill came between the two renames.

A failed write (a full disk, a file-size limit, a permission) removes the staging folder, leaves
the target untouched and raises one :class:`~harts_runtime.errors.InvalidInputError` naming the
file being written, on every rank alike; torch's ``CheckpointException`` (a ``BaseException``)
never escapes. A target that exists but is a file, or a non-empty folder that is no checkpoint, is
refused before anything is written (a save never deletes what it did not write).

:func:`verify_folder` checks a folder against its manifest before anything is loaded: a missing,
truncated, extended or altered file (one flipped bit is enough) is one :class:`InvalidInputError`
whose ``.field`` is the file's name. Folders saved before manifests existed load unverified.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

from harts_runtime.errors import InvalidInputError

__all__ = [
    "MANIFEST_NAME",
    "as_input_error",
    "loadable_folder",
    "staged_folder",
    "verify_folder",
]

MANIFEST_NAME = "manifest.json"
"""The file of a checkpoint listing every other file with its size and SHA-256."""
_MANIFEST_FORMAT = "harts-manifest-1"
_MARKERS = (".metadata", MANIFEST_NAME, "harts.json")  # any one: the folder is a checkpoint
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_CHUNK = 8 << 20


# ------------------------------------------------------------------------------ processes
def _dist():
    """torch.distributed when a process group is initialised, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def _gather(obj) -> list:
    """Every rank's ``obj`` (a list of one in one process)."""
    dist = _dist()
    if dist is None:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def _agree(local: InvalidInputError | None) -> InvalidInputError | None:
    """The first rank's error, on every rank (None when no rank has one)."""
    payload = None
    if local is not None:
        text = str(local)
        payload = (local.field, text[len(local.field) + 2 :] if text.startswith(f"{local.field}: ") else text)
    for p in _gather(payload):
        if p is not None:
            return local if local is not None and payload == p else InvalidInputError(*p)
    return None


# ------------------------------------------------------------------------------ errors
def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failing(exc: BaseException) -> tuple[int | None, BaseException]:
    """``(rank, exception)`` inside torch's ``CheckpointException`` (the first failing rank's);
    ``(None, exc)`` for any other exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            deeper, root = _failing(inner)
            return (rank if deeper is None else deeper), root
    return None, exc


def _root(exc: BaseException) -> BaseException:
    """The exception inside torch's ``CheckpointException`` (the first failing rank's)."""
    return _failing(exc)[1]


def _cause(exc: BaseException) -> BaseException:
    """The ``OSError`` or ``InvalidInputError`` behind ``exc`` (torch's serializer reports a failed
    write as ``RuntimeError: unexpected pos`` raised while handling the ``OSError``), else ``exc``."""
    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, (OSError, InvalidInputError)):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return exc


def _newest_file(folder: Path, rank: int | None = None) -> Path | None:
    """The file of ``folder`` written last (of DCP's ``__<rank>_*`` files when ``rank`` is known)."""
    try:
        files = [p for p in folder.iterdir() if p.is_file()]
    except OSError:
        return None
    if rank is not None:
        files = [p for p in files if p.name.startswith(f"__{rank}_")] or files
    return max(files, key=lambda p: p.stat().st_mtime_ns, default=None)


def as_input_error(exc: BaseException, folder, doing: str) -> InvalidInputError | None:
    """``exc`` (raised while ``doing`` something with ``folder``; torch's ``CheckpointException``
    unwrapped) as one :class:`InvalidInputError` naming the file: for an ``OSError`` (a full disk
    or file-size limit said as such) or an ``InvalidInputError``; None for anything else."""
    rank, exc = _failing(exc)
    exc = _cause(exc)
    if isinstance(exc, InvalidInputError):
        return exc
    if not isinstance(exc, OSError):
        return None
    folder = Path(folder)
    if exc.filename:
        file = Path(exc.filename)
    else:  # the writer does not say which file: the one written last
        file = _newest_file(folder, rank) or folder
    name = file.name or str(file)
    if exc.errno in _NO_SPACE:
        what = {errno.EFBIG: "the file-size limit was reached", errno.EDQUOT: "the disk quota is full"}.get(
            exc.errno, "no space left on the device"
        )
        return InvalidInputError(name, f"{what} while {doing} ({file})")
    return InvalidInputError(name, f"{_one_line(exc.strerror or exc)} while {doing} ({file})")


# ------------------------------------------------------------------------------ files
def _digest(path: Path, sync: bool = False) -> dict:
    """``{"bytes": n, "sha256": hex}`` of a file (synced to disk first when ``sync``)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync a folder
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` atomically (Linux ``renameat2``); False where the system or
    filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _backup(target: Path) -> Path:
    return target.parent / f".{target.name}.replaced"


def _put_in_place(staging: Path, target: Path) -> None:
    """Make ``staging`` the folder ``target`` (module docstring); the previous one is removed."""
    if not target.exists():
        os.rename(staging, target)
    elif _exchange(staging, target):
        _sync_dir(target.parent)
        _remove(staging)  # now the previous checkpoint
    else:
        old = _backup(target)
        _remove(old)
        os.rename(target, old)
        os.rename(staging, target)
        _sync_dir(target.parent)
        _remove(old)
    _sync_dir(target.parent)


def _check_target(target: Path) -> None:
    """Refuse a target a save would destroy: a file, or a non-empty folder that is no checkpoint."""
    if target.exists() and not target.is_dir():
        raise InvalidInputError("path", f"{target} exists and is not a folder: refusing to replace it")
    if target.is_dir():
        try:
            names = os.listdir(target)
        except OSError as e:
            raise InvalidInputError("path", f"{target} cannot be listed ({e.strerror})") from None
        if names and not any(m in names for m in _MARKERS):
            raise InvalidInputError(
                "path",
                f"{target} is a non-empty folder that is not a checkpoint: refusing to replace it "
                "(give a new or empty folder, or a checkpoint to overwrite)",
            )


@contextlib.contextmanager
def staged_folder(path):
    """Write a checkpoint at ``path`` whole or not at all (module docstring); collective. Yields the
    staging folder every rank writes its files into; on a clean exit the files are checksummed, the
    manifest written and the folder put in place; on an error the staging folder is removed and an
    :class:`InvalidInputError` naming the file raised on every rank."""
    target = Path(os.path.realpath(path))  # through a link: staged and replaced where it points
    staging = target.parent / f".{target.name}.saving"
    rank, world = _rank_world()
    _check_target(target)
    err = None
    if rank == 0:
        try:
            _remove(staging)  # a save killed before
            target.parent.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
        except OSError as e:
            err = as_input_error(e, target.parent, f"creating {staging}")
    err = _agree(err)
    if err is not None:
        raise err
    doing = f"saving the checkpoint {target}"
    failure = None
    try:
        yield staging
    except KeyboardInterrupt:
        if rank == 0:
            _remove(staging)
        raise
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        failure = e
        err = as_input_error(e, staging, doing)
    if failure is not None and err is None:
        root = _root(failure)
        err = InvalidInputError("path", f"{doing} failed: {type(root).__name__}: {_one_line(root)}")
    err = _agree(err)
    if err is None:  # every rank wrote its files: checksum them (a share each), manifest, rename
        _barrier()
        names = sorted(n for n in os.listdir(staging) if n != MANIFEST_NAME and (staging / n).is_file())
        sums, local = {}, None
        try:
            for n in names[rank::world]:
                sums[n] = _digest(staging / n, sync=True)
        except OSError as e:
            local = as_input_error(e, staging, doing)
        err = _agree(local)
        if err is None:
            files = {}
            for part in _gather(sums):
                files.update(part)
            if rank == 0:
                try:
                    record = {"format": _MANIFEST_FORMAT, "algorithm": "sha256", "files": files}
                    m = staging / MANIFEST_NAME
                    with open(m, "w") as f:
                        f.write(json.dumps(record, indent=1, sort_keys=True) + "\n")
                        f.flush()
                        os.fsync(f.fileno())
                    _sync_dir(staging)
                    _put_in_place(staging, target)
                except OSError as e:
                    local = as_input_error(e, staging, doing)
            err = _agree(local)
    if err is not None:
        if rank == 0:
            _remove(staging)
        _barrier()
        if failure is not None and err is not failure:
            raise err from (failure if isinstance(failure, Exception) else None)
        raise err
    _barrier()


# ------------------------------------------------------------------------------ loading
def loadable_folder(path) -> Path:
    """``path``, or its ``.<name>.replaced`` folder where a save without folder exchange was killed
    between its two renames (``path`` missing, the previous checkpoint beside it)."""
    p = Path(path)
    if not p.exists():
        old = _backup(Path(os.path.abspath(p)))
        if (old / MANIFEST_NAME).is_file():
            return old
    return p


def read_manifest(folder: Path) -> dict | None:
    """The ``files`` record of ``folder``'s manifest, or None where there is none."""
    m = folder / MANIFEST_NAME
    if not m.exists():
        return None
    try:
        record = json.loads(m.read_text())
        files = record["files"]
        if record.get("format") != _MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"unknown format {record.get('format')!r}")
        for n, v in files.items():
            if "/" in n or n in ("", ".", "..") or not isinstance(v, dict):
                raise ValueError(f"bad entry {n!r}")
            if not isinstance(v.get("bytes"), int) or not isinstance(v.get("sha256"), str):
                raise ValueError(f"bad entry {n!r}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise InvalidInputError(MANIFEST_NAME, f"{m} is unreadable or damaged ({_one_line(e)})") from None
    return files


def verify_folder(folder, required: bool = False) -> None:
    """Check every file of ``folder``'s manifest: present, of its size, of its SHA-256 (each rank
    a share of the files; collective under torch.distributed, the same error on every rank).
    Raises :class:`InvalidInputError` naming the first bad file; a folder without a manifest
    passes unless ``required``."""
    folder = Path(folder)
    files = read_manifest(folder)
    if files is None:
        if required:
            raise InvalidInputError(MANIFEST_NAME, f"missing from the checkpoint {folder}")
        return
    for n in sorted(files):
        f = folder / n
        if not f.is_file():
            raise InvalidInputError(n, f"missing from the checkpoint {folder} (listed in {MANIFEST_NAME})")
        size = f.stat().st_size
        if size != files[n]["bytes"]:
            raise InvalidInputError(
                n, f"{f} has {size} bytes, {files[n]['bytes']} were saved (truncated or damaged)"
            )
    rank, world = _rank_world()
    local = None
    for n in sorted(files)[rank::world]:
        try:
            got = _digest(folder / n)["sha256"]
        except OSError as e:
            local = as_input_error(e, folder, f"verifying the checkpoint {folder}")
            break
        if got != files[n]["sha256"]:
            local = InvalidInputError(n, f"{folder / n} is damaged: its SHA-256 differs from the saved one")
            break
    err = _agree(local)
    if err is not None:
        raise err
