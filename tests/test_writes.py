"""What a writer of engine files hands torch.save, and the digests taken of its files as they are finished."""

from __future__ import annotations

import os
import zipfile

import torch

from converters.pickle_safety import save_torch
from interop import digests, written_digests
from interop.tensors import own_storage
from interop.verify import tree_records


def test_a_row_slice_is_saved_as_its_own_bytes_without_a_copy(tmp_path):
    """A TP rank's rows of a loaded tensor are saved as just their bytes (torch.save writes a view's whole storage),
    sharing the loaded tensor's memory; a column slice is copied; a tensor of its own is passed as it is."""
    full = torch.randn(8, 6)
    rows, cols = full.chunk(2, dim=0)[1], full.chunk(2, dim=1)[1]
    own_rows, own_cols = own_storage(rows), own_storage(cols)
    assert own_rows.data_ptr() == rows.data_ptr() and own_rows.untyped_storage().nbytes() == rows.nbytes
    assert own_cols.is_contiguous() and own_cols.untyped_storage().nbytes() == cols.nbytes
    assert own_storage(full) is full
    bf16 = torch.randn(4, 4).to(torch.bfloat16)[2:]
    assert torch.equal(own_storage(bf16), bf16) and own_storage(bf16).dtype == torch.bfloat16
    save_torch({"rows": own_rows, "cols": own_cols}, str(tmp_path / "f.pt"))
    stored = [i.file_size for i in zipfile.ZipFile(tmp_path / "f.pt").infolist() if "/data/" in i.filename]
    assert sorted(stored) == [rows.nbytes, cols.nbytes]  # not the 192 bytes of ``full``
    back = torch.load(tmp_path / "f.pt", weights_only=True)
    assert torch.equal(back["rows"], rows) and torch.equal(back["cols"], cols)


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
