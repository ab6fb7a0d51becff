"""AOTInductor packages unpacked where the runtime owns them: $HIGGS_RT_HOME/packages/, one entry per package content.

torch's package loader extracts a .pt2 into a fresh $TMPDIR/aotinductor_* directory (about 3.3 MB for a CPU
package, more for a CUDA one) and removes it only when the loader is destroyed: a package that fails to load (the
loader's constructor throws after extracting), a process that is killed or crashes, or one that ends without
destroying its loaders (os._exit) leaves the directory behind. Where torch's loader takes an unpacked directory
(`torch_compat.load_package` says where), `unpack` extracts a package once, under its content's sha256, and every
later load of the same package, in this process or another, reuses that entry: nothing goes to $TMPDIR, and
whatever ends a process, what it leaves is an entry the next load reuses.

Bound: past MAX_BYTES of entries, the least recently used go first, after each extraction. An entry in use is never
removed: a process holds a shared flock on the entry's lock file for as long as a package loaded from it lives
(`Unpacked.hold`; the kernel drops it when the process ends, however it ends); removal takes an exclusive one
without waiting, and moves the entry aside before deleting it. An extraction is written beside the entries and
renamed into place, so a crash never leaves half a package where a load would take it; such leftovers are removed
by a later trim once they are an hour old.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path
from typing import IO, NamedTuple

from .home import default_home

SUBDIR = "packages"
MAX_BYTES = 1 << 30
LOCK = ".lock"
PARTIAL, REMOVING = ".partial-", ".removing-"
STALE_S = 3600.0  # a partial extraction this old was cut short by a crash


class Unpacked(NamedTuple):
    """An unpacked package: the directory to load, and the open lock file whose shared lock keeps it from removal
    (keep it open as long as the package loaded from it lives)."""

    directory: Path
    hold: IO[bytes]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unpack(path: Path, sha256: str | None = None, root: Path | None = None) -> Unpacked:
    """The package at `path` (whose sha256 is `sha256`, computed when not given) unpacked under `root` (default
    $HIGGS_RT_HOME/packages), extracted now unless an entry of the same content exists; OSError where the
    directory cannot be written or is on a file system mounted noexec (its libraries would not load from there),
    zipfile.BadZipFile for a file that is not a package."""
    import fcntl

    root = Path(root) if root is not None else default_home() / SUBDIR
    if _noexec(root):
        raise OSError(f"{root} is on a file system mounted noexec: a package's library cannot be loaded from it")
    entry = root / (sha256 or file_sha256(path))[:32]
    for _ in range(3):  # an entry removed between finding and locking it is extracted again
        hold = _held(entry, fcntl)
        if hold is not None:
            return Unpacked(entry, hold)
        _extract(path, entry)
        _trim(root, keep=entry, fcntl=fcntl)
    raise OSError(f"{entry} was removed as often as it was unpacked")


def _noexec(path: Path) -> bool:
    """Whether `path` (or, where it does not exist yet, its nearest existing parent) is on a noexec mount."""
    for place in (path, *path.parents):
        try:
            return bool(os.statvfs(place).f_flag & getattr(os, "ST_NOEXEC", 0))
        except FileNotFoundError:
            continue
        except OSError:
            return False
    return False


def _held(entry: Path, fcntl) -> IO[bytes] | None:
    """The entry's lock file, open and share-locked, or None when there is no such entry (any more)."""
    try:
        hold = open(entry / LOCK, "rb")
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(hold, fcntl.LOCK_SH)  # waits out a removal in progress (a rename)
        now, held = os.stat(entry / LOCK), os.fstat(hold.fileno())
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):  # removed and extracted again meanwhile
            raise FileNotFoundError
        os.utime(entry / LOCK)  # its last use: the trim's order
    except FileNotFoundError:
        hold.close()
        return None
    except BaseException:
        hold.close()
        raise
    return hold


def _extract(path: Path, entry: Path) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=entry.parent, prefix=PARTIAL))
    try:
        with zipfile.ZipFile(path) as archive:
            archive.extractall(partial)
        (partial / LOCK).touch()
        try:
            partial.rename(entry)
        except OSError:
            if not (entry / LOCK).exists():  # else another process unpacked the same package first
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _trim(root: Path, keep: Path, fcntl) -> None:
    """Remove the least recently used entries not in use until the rest fit MAX_BYTES (never `keep`), and
    leftovers of crashed extractions or removals."""
    entries = []
    for child in root.iterdir():
        if child.name.startswith((PARTIAL, REMOVING)):
            try:
                if time.time() - child.stat().st_mtime > STALE_S:
                    shutil.rmtree(child, ignore_errors=True)
            except FileNotFoundError:
                pass
            continue
        try:
            entries.append((os.stat(child / LOCK).st_mtime, _size(child), child))
        except OSError:  # being removed, or not an entry
            continue
    total = sum(size for _, size, _ in entries)
    for _, size, child in sorted(entries):
        if total <= MAX_BYTES:
            break
        if child != keep and _remove(root, child, fcntl):
            total -= size


def _remove(root: Path, entry: Path, fcntl) -> bool:
    """Remove an entry that no process holds; False when one does (or it is gone already)."""
    try:
        lock = open(entry / LOCK, "rb")
    except FileNotFoundError:
        return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        aside = Path(tempfile.mkdtemp(dir=root, prefix=REMOVING))
        try:
            entry.rename(aside / entry.name)
        except OSError:
            aside.rmdir()
            return False
    shutil.rmtree(aside, ignore_errors=True)
    return True
