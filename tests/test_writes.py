"""What a writer of engine files hands torch.save, and the digests taken of its files as they are finished."""

from __future__ import annotations

import os

import torch

from converters.pickle_safety import save_torch
from interop import digests, written_digests
from interop.verify import tree_records


def test_files_are_hashed_as_they_are_finished_and_again_if_changed(tmp_path, monkeypatch):
    """Inside digesting_as_written, a file save_torch writes is hashed as it is written, and tree_records takes that
    digest instead of reading the file again; a file changed after it was hashed is hashed again, so the manifest's
    digest is always of the bytes on disk."""
    root = tmp_path / "out"
    root.mkdir()
    with written_digests.digesting_as_written() as ahead:
        save_torch({"w": torch.randn(300_000)}, str(root / "kept.pt"))
        save_torch({"w": torch.randn(1000)}, str(root / "changed.pt"))
        ahead.digest(str(root / "kept.pt"))  # both hashed before one is changed
        ahead.digest(str(root / "changed.pt"))
        torch.save({"w": torch.zeros(1000)}, str(root / "changed.pt"))  # same size, other bytes
        st = os.stat(root / "changed.pt")
        os.utime(root / "changed.pt", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        read = []
        real = digests.of_files
        monkeypatch.setattr(digests, "of_files", lambda paths, *a, **k: read.extend(paths) or real(paths, *a, **k))
        records = tree_records(str(root), ".", ahead=ahead)
    assert [os.path.basename(p) for p in read] == ["changed.pt"]
    for name in ("kept.pt", "changed.pt"):
        path = str(root / name)
        assert records[name].digest == real([path])[path].digest
    assert written_digests._CURRENT is None
