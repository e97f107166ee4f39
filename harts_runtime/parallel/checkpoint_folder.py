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
never escapes.

A save never deletes what it did not write. A target that exists is replaced only when it is a
HARTS checkpoint by its content (:func:`not_a_checkpoint`): its ``manifest.json`` is a HARTS
manifest (``"format": "harts-manifest-1"``) that lists exactly the folder's other files, each at
its listed size (or, saved before manifests, a ``harts.json`` of HARTS's format beside DCP's
``.metadata`` and plain files only); an empty folder is fine. Anything else (a file, a folder
holding a ``README.md`` and ``src/`` beside a file that happens to be named ``manifest.json``,
``.metadata`` or ``harts.json``) is refused before anything is written, naming the path and what
is there. A stale ``.<name>.saving`` or ``.<name>.replaced`` beside it is removed only when it is
a save's own (the staging folder holds a marker file from its creation until its manifest is
written; a complete one is a checkpoint by content).

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
    "not_a_checkpoint",
    "read_manifest",
    "staged_folder",
    "verify_files",
    "verify_folder",
]

MANIFEST_NAME = "manifest.json"
"""The file of a checkpoint listing every other file with its size and SHA-256."""
_MANIFEST_FORMAT = "harts-manifest-1"
_LEGACY_RECORD, _LEGACY_FORMAT = "harts.json", "harts-dcp-1"  # a checkpoint saved before manifests
_STAGING_MARK = ".harts-saving"  # in a staging folder from its creation until its manifest is written
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
def _one_line(text: object, limit: int = 300) -> str:
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
    """Remove a save's own folder (or file). The marker goes in first and out last, so a kill
    part-way leaves a folder the next save still recognises as its own."""
    if path.is_dir() and not path.is_symlink():
        mark = path / _STAGING_MARK
        try:
            mark.touch()
            for child in os.listdir(path):
                if child != _STAGING_MARK:
                    c = path / child
                    if c.is_dir() and not c.is_symlink():
                        shutil.rmtree(c, ignore_errors=True)
                    else:
                        c.unlink(missing_ok=True)
            mark.unlink(missing_ok=True)
            path.rmdir()
        except OSError:
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


def _listing(folder: Path, names: list[str], limit: int = 6) -> str:
    shown = [
        n + ("/" if (folder / n).is_dir() and not (folder / n).is_symlink() else "") for n in names[:limit]
    ]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(shown) + more


def not_a_checkpoint(folder) -> str | None:
    """Why the existing folder ``folder`` is not a HARTS checkpoint a save may replace; None when it
    is one (or is empty). Recognised by content, not by file names (module docstring)."""
    folder = Path(folder)
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        return f"it cannot be listed ({e.strerror or e})"
    if not names:
        return None
    holds = f"it holds {_listing(folder, names)}"
    if MANIFEST_NAME in names:
        try:
            files = read_manifest(folder)
        except InvalidInputError:
            return f"{holds}, and its {MANIFEST_NAME} is not a HARTS manifest"
        assert files is not None  # the manifest is among the names listed above
        unlisted = [n for n in names if n != MANIFEST_NAME and n not in files]
        if unlisted:
            return f"{holds}; its {MANIFEST_NAME} does not list {_listing(folder, unlisted)}"
        for n in sorted(files):
            f = folder / n
            if f.is_symlink() or not f.is_file():
                return f"{holds}; its {MANIFEST_NAME} lists {n}, which is not a file there"
            if f.stat().st_size != files[n]["bytes"]:
                return f"{holds}; {n} is not of the size its {MANIFEST_NAME} lists"
        return None
    if _LEGACY_RECORD in names and ".metadata" in names:
        try:
            record = json.loads((folder / _LEGACY_RECORD).read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            record = None
        plain = all((folder / n).is_file() and not (folder / n).is_symlink() for n in names)
        if isinstance(record, dict) and record.get("format") == _LEGACY_FORMAT and plain:
            return None
    return f"{holds}, and no HARTS manifest"


def _own_leftover(folder: Path) -> bool:
    """Whether ``folder`` (a ``.<name>.saving`` or ``.<name>.replaced``) is a save's own."""
    try:
        if _STAGING_MARK in os.listdir(folder):
            return True
    except OSError:
        return False
    return not_a_checkpoint(folder) is None


def _check_target(target: Path) -> None:
    """Refuse a target a save would destroy: a file, or a folder that is no HARTS checkpoint; and a
    stale staging or backup folder beside it that is not a save's own."""
    if target.exists() and not target.is_dir():
        raise InvalidInputError("path", f"{target} exists and is not a folder: refusing to replace it")
    if target.is_dir():
        why = not_a_checkpoint(target)
        if why is not None:
            raise InvalidInputError(
                "path",
                f"{target} is not a HARTS checkpoint ({why}): refusing to replace it "
                "(give a new or empty folder, or a HARTS checkpoint to overwrite)",
            )
    for leftover in (_staging(target), _backup(target)):
        if (leftover.exists() or leftover.is_symlink()) and (
            leftover.is_symlink() or not leftover.is_dir() or not _own_leftover(leftover)
        ):
            raise InvalidInputError(
                "path",
                f"{leftover} is in the way of the save to {target} and is not a save's own folder: "
                "refusing to remove it (move it away)",
            )


def _staging(target: Path) -> Path:
    return target.parent / f".{target.name}.saving"


@contextlib.contextmanager
def staged_folder(path):
    """Write a checkpoint at ``path`` whole or not at all (module docstring); collective. Yields the
    staging folder every rank writes its files into; on a clean exit the files are checksummed, the
    manifest written and the folder put in place; on an error the staging folder is removed and an
    :class:`InvalidInputError` naming the file raised on every rank."""
    target = Path(os.path.realpath(path))  # through a link: staged and replaced where it points
    staging = _staging(target)
    rank, world = _rank_world()
    err = None
    try:
        _check_target(target)
    except InvalidInputError as e:
        err = e
    err = _agree(err)
    if err is not None:
        raise err
    if rank == 0:
        try:
            _remove(staging)  # a save killed before (checked to be a save's own)
            target.parent.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
            (staging / _STAGING_MARK).write_bytes(b"")
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
        names = sorted(
            n
            for n in os.listdir(staging)
            if n not in (MANIFEST_NAME, _STAGING_MARK) and (staging / n).is_file()
        )
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
                    (staging / _STAGING_MARK).unlink()
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


MAX_MANIFEST_BYTES = 64 << 20
"""The largest manifest read (about 300,000 files' entries): a larger one is refused before it is read."""


def read_manifest(folder: Path) -> dict | None:
    """The ``files`` record of ``folder``'s manifest, or None where there is none; a manifest over
    :data:`MAX_MANIFEST_BYTES` is refused naming it and the limit, unread."""
    m = folder / MANIFEST_NAME
    if not m.exists():
        return None
    try:
        size = m.stat().st_size
    except OSError as e:
        raise InvalidInputError(MANIFEST_NAME, f"{m} is unreadable ({_one_line(e)})") from None
    if size > MAX_MANIFEST_BYTES:
        raise InvalidInputError(
            MANIFEST_NAME, f"{m} holds {size:,} bytes, over the {MAX_MANIFEST_BYTES:,} a manifest may hold"
        )
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


def _check_file(folder: Path, n: str, entry: dict) -> InvalidInputError | None:
    f = folder / n
    if not f.is_file():
        return InvalidInputError(n, f"missing from the checkpoint {folder} (listed in {MANIFEST_NAME})")
    size = f.stat().st_size
    if size != entry["bytes"]:
        return InvalidInputError(
            n, f"{f} has {size} bytes, {entry['bytes']} were saved (truncated or damaged)"
        )
    return None


def verify_files(folder, names) -> None:
    """Check the files ``names`` of ``folder`` against its manifest (each listed, of its size and
    SHA-256; one process, not collective): for a small file read before the whole folder is
    verified. Raises :class:`InvalidInputError` naming the first bad file or the missing manifest."""
    folder = Path(folder)
    files = read_manifest(folder)
    if files is None:
        raise InvalidInputError(MANIFEST_NAME, f"missing from the checkpoint {folder}")
    for n in names:
        if n not in files:
            raise InvalidInputError(n, f"{folder / n} is not listed in the checkpoint's {MANIFEST_NAME}")
        err = _check_file(folder, n, files[n])
        if err is not None:
            raise err
        try:
            got = _digest(folder / n)["sha256"]
        except OSError as e:
            err = as_input_error(e, folder, f"verifying the checkpoint {folder}")
            raise (err if err is not None else e) from None
        if got != files[n]["sha256"]:
            raise InvalidInputError(n, f"{folder / n} is damaged: its SHA-256 differs from the saved one")


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
        err = _check_file(folder, n, files[n])
        if err is not None:
            raise err
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
