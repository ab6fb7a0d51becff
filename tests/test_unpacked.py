"""higgs_rt.unpacked on stand-in packages (zip files; no torch package is loaded here, test_export.py loads real
ones): one entry per content, reused; the least recently used go past the bound, never one in use; partial
extractions are never taken and are cleared once stale."""

from __future__ import annotations

import os
import time
import zipfile

import pytest

from higgs_rt import unpacked
from higgs_rt.unpacked import LOCK, unpack


def package(path, payload: bytes = b"x" * 1000):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("model/data/aotinductor/model/kernel.so", payload)
        z.writestr("model/archive_format", "pt2")
    return path


def test_a_package_is_unpacked_once_by_content_and_reused(tmp_path, monkeypatch):
    root = tmp_path / "packages"
    first = unpack(package(tmp_path / "a.pt2"), root=root)
    assert (first.directory / "model/data/aotinductor/model/kernel.so").read_bytes() == b"x" * 1000
    assert first.directory.parent == root and first.hold.name == str(first.directory / LOCK)
    extracted = []
    monkeypatch.setattr(unpacked, "_extract", lambda *a: extracted.append(a))
    again = unpack(package(tmp_path / "same-content.pt2"), root=root)
    assert again.directory == first.directory and extracted == []  # reused, not extracted again
    assert sorted(p.name for p in root.iterdir()) == [first.directory.name]  # no partial left beside it


def test_a_package_unpacked_meanwhile_by_another_process_is_taken_as_it_is(tmp_path):
    path, root = package(tmp_path / "a.pt2"), tmp_path / "packages"
    entry = root / unpacked.file_sha256(path)[:32]
    unpacked._extract(path, entry)
    unpacked._extract(path, entry)  # its rename loses to the entry in place: no error, no partial left
    assert sorted(p.name for p in root.iterdir()) == [entry.name]


def test_past_the_bound_the_least_recently_used_entry_not_in_use_goes(tmp_path, monkeypatch):
    monkeypatch.setattr(unpacked, "MAX_BYTES", 2500)  # two of the 1000-byte packages, not three
    root = tmp_path / "packages"
    held = unpack(package(tmp_path / "held.pt2", b"h" * 1000), root=root)  # in use: its lock stays open
    idle = unpack(package(tmp_path / "idle.pt2", b"i" * 1000), root=root)
    idle.hold.close()
    for entry, age in ((held.directory, 300), (idle.directory, 200)):  # the held one is the least recent
        os.utime(entry / LOCK, (time.time() - age,) * 2)
    new = unpack(package(tmp_path / "new.pt2", b"n" * 1000), root=root)
    assert sorted(p.name for p in root.iterdir()) == sorted([held.directory.name, new.directory.name])
    held.hold.close()
    newer = unpack(package(tmp_path / "newer.pt2", b"m" * 1000), root=root)  # now the held one may go
    assert sorted(p.name for p in root.iterdir()) == sorted([new.directory.name, newer.directory.name])


def test_an_entry_removed_while_it_is_found_is_unpacked_again(tmp_path, monkeypatch):
    path, root = package(tmp_path / "a.pt2"), tmp_path / "packages"
    first = unpack(path, root=root)
    first.hold.close()
    held = unpacked._held

    def removed_meanwhile(entry, fcntl):  # a trim in another process moves it aside between open and lock
        monkeypatch.setattr(unpacked, "_held", held)
        assert unpacked._remove(root, entry, fcntl)
        return held(entry, fcntl)

    monkeypatch.setattr(unpacked, "_held", removed_meanwhile)
    again = unpack(path, root=root)
    assert (again.directory / "model/archive_format").read_text() == "pt2"


def test_partial_extractions_are_never_taken_and_go_once_stale(tmp_path, monkeypatch):
    root = tmp_path / "packages"
    path = package(tmp_path / "a.pt2")
    stale, fresh = root / ".partial-crashed", root / ".partial-running"
    for partial in (stale, fresh):
        (partial / "model").mkdir(parents=True)
    os.utime(stale, (time.time() - 2 * unpacked.STALE_S,) * 2)
    got = unpack(path, root=root)
    assert got.directory.name == unpacked.file_sha256(path)[:32]
    assert not stale.exists() and fresh.exists()


def test_a_file_that_is_not_a_package_is_refused_and_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"not a zip")
    with pytest.raises(zipfile.BadZipFile):
        unpack(bad, root=tmp_path / "packages")
    assert list((tmp_path / "packages").iterdir()) == []


def test_a_home_mounted_noexec_is_refused_before_anything_is_extracted(tmp_path, monkeypatch):
    """On a noexec file system the package's library would not load (torch's loader failed on mapping it and the
    runtime fell back to eager): unpack refuses the place with an OSError, so load_package takes the .pt2 (torch's
    own extraction into $TMPDIR), and nothing is written under the home. The mount flag of the nearest existing
    parent counts where the packages directory does not exist yet."""
    seen = []

    class Noexec:
        f_flag = os.ST_NOEXEC

    def statvfs(place):
        seen.append(place)
        if not os.path.exists(place):
            raise FileNotFoundError(place)
        return Noexec()

    monkeypatch.setattr(unpacked.os, "statvfs", statvfs)
    root = tmp_path / "home" / "packages"
    with pytest.raises(OSError, match="mounted noexec: a package's library cannot be loaded from it"):
        unpack(package(tmp_path / "a.pt2"), root=root)
    assert not (tmp_path / "home").exists() and seen[-1] == tmp_path
    monkeypatch.setattr(Noexec, "f_flag", 0)  # the same place mounted exec: unpacked as before
    assert (unpack(package(tmp_path / "a.pt2"), root=root).directory / "model/archive_format").exists()
