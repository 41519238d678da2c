"""torch.save's format written here (converters.torch_save) and DCP data files streamed with it (converters.dcp):
the same bytes torch.save writes, ZIP64 included; real CRCs; a stacked tensor written part by part, never built;
every mapped source byte checked against its digest; the data file's digest taken as it is written."""

from __future__ import annotations

import dataclasses
import io
import os
import zipfile

import pytest
import torch
from safetensors.torch import save_file

from converters import torch_save
from converters.dcp import load_dcp, write_dcp
from interop import digests, written_digests
from interop.errors import CorruptCheckpointError
from interop.safetensors_io import SafetensorsFile
from interop.tensors import LazyTensor, TensorSpec, raw_bytes
from tests.conftest import flip_byte

ID = "archive/.data/serialization_id"  # an opaque id: torch's own mixes in a hash of its record names


def ours(t: torch.Tensor) -> bytes:
    out = io.BytesIO()
    n = torch_save.write_tensor(out, tuple(t.shape), t.dtype, t.nbytes, [raw_bytes(t)])
    assert n == len(out.getvalue())
    return out.getvalue()


def id_spans(data: bytes) -> list[tuple[int, int]]:
    """Where the id record's bytes and its two CRC copies lie (its data descriptor's, its central entry's), found
    by the record's name (the tail of a file works as well as the whole)."""
    name = ID.encode()
    local = data.rfind(b"PK\x03\x04", 0, data.find(name))
    start = local + 30 + int.from_bytes(data[local + 26 : local + 28], "little") + int.from_bytes(data[local + 28 : local + 30], "little")
    central = data.rfind(b"PK\x01\x02", 0, data.rfind(name))
    return [(start, start + 40), (start + 44, start + 48), (central + 16, central + 20)]


def masked(data: bytes) -> bytes:
    out = bytearray(data)
    for lo, hi in id_spans(data):
        out[lo:hi] = bytes(hi - lo)
    return bytes(out)


def saved_as_torch_saves(tmp_path, name: str, ours_obj, loaded):
    """``ours_obj`` written by save_torch beside torch.save of ``loaded`` (the same, loaded): every byte but the id
    the same, real CRCs, and the digest taken as written the file's. The path of ours."""
    from converters.pickle_safety import save_torch

    theirs, mine = tmp_path / "theirs" / name, tmp_path / name
    theirs.parent.mkdir(exist_ok=True)
    torch.save(loaded, theirs)
    with written_digests.digesting_as_written() as taken:
        save_torch(ours_obj, str(mine))
        assert taken.digest(str(mine)) == digests.of_files([str(mine)])[str(mine)]
    assert masked(mine.read_bytes()) == masked(theirs.read_bytes())
    assert zipfile.ZipFile(mine).testzip() is None
    return mine


@pytest.mark.parametrize("t", [torch.arange(10, dtype=torch.bfloat16).reshape(2, 5), torch.randn(3, 4, 5), torch.tensor(3.5),
                               torch.empty(0, 4), torch.arange(7), torch.ones(3, dtype=torch.bool), torch.randn(2, 2).half(),
                               torch.randn(2, 3).to(torch.float8_e4m3fn), torch.tensor([[1, 2], [3, 4]], dtype=torch.uint16)],
                         ids=["bf16", "fp32-3d", "scalar", "empty", "int64", "bool", "fp16", "float8", "uint16"])  # the last two: untyped storages
def test_a_tensor_is_written_as_torch_save_writes_it(t):
    reference = io.BytesIO()
    torch.save(t, reference)
    written = ours(t)
    assert masked(written) == masked(reference.getvalue())  # every byte but the opaque id
    assert zipfile.ZipFile(io.BytesIO(written)).testzip() is None  # real CRCs: any zip reader takes it
    back = torch.load(io.BytesIO(written), weights_only=True)
    assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride() and torch.equal(back, t)


def test_zip64_records_are_laid_out_as_torch_lays_them_out(tmp_path):
    """A record of 4 GiB and more, and records past 4 GiB: torch.save's ZIP64 fields, byte for byte. Both files are
    sparse (torch's skip_data leaves its data unwritten, ours seeks over zeros), so nothing 4 GiB is written."""
    n = (1 << 32) + 64
    theirs, mine = tmp_path / "theirs.pt", tmp_path / "ours.pt"
    with torch.serialization.skip_data(), open(theirs, "wb") as f:
        torch.save(torch.empty(n, dtype=torch.uint8), f)
    zeros = memoryview(bytes(64 << 20))

    class Sparse(io.FileIO):
        def write(self, b):
            if isinstance(b, memoryview) and b.obj is zeros.obj:
                self.seek(len(b), os.SEEK_CUR)
                return len(b)
            return super().write(b)

    crc = torch_save.crc32  # skip_data leaves the data's CRC at 0: so do we, for the skipped bytes
    with Sparse(mine, "w") as f, pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_save, "crc32", lambda chunk, value=0: value if getattr(chunk, "obj", None) is zeros.obj else crc(chunk, value))
        torch_save.write_tensor(f, (n,), torch.uint8, n, [zeros] * (n // len(zeros)) + [zeros[: n % len(zeros)]])
    assert os.path.getsize(mine) == os.path.getsize(theirs)
    with open(theirs, "rb") as a, open(mine, "rb") as b:
        assert a.read(4096) == b.read(4096)  # the headers before the data
        a.seek(n)
        b.seek(n)
        assert masked(b.read()) == masked(a.read())  # from the end of the data: descriptors, later records, directory
    info = zipfile.ZipFile(mine).getinfo("archive/data/0")
    assert info.file_size == n


class Parts:
    """A stacked tensor offered layer by layer; building it whole is an error (the writer must stream it)."""

    def __init__(self, layers: list[torch.Tensor]):
        self.layers = layers
        self.loaded = 0

    def lazy(self) -> LazyTensor:
        def whole():
            raise AssertionError("the stacked tensor was built")

        def part(t):
            def load():
                self.loaded += 1
                return t
            return LazyTensor(TensorSpec(tuple(t.shape), t.dtype), load, "layer")

        shape = (len(self.layers), *self.layers[0].shape)
        return LazyTensor(TensorSpec(shape, self.layers[0].dtype), whole, "stacked", parts=lambda: (part(t) for t in self.layers))


def mapped_source(tmp_path, tensors: dict[str, torch.Tensor]) -> dict[str, LazyTensor]:
    """A safetensors file's tensors as mapped LazyTensors with their digests recorded, as a universal source's are."""
    path = tmp_path / "source.safetensors"
    save_file(tensors, str(path))
    st = SafetensorsFile(str(path))
    return {k: dataclasses.replace(st.lazy(k), digest=digests.of_bytes(raw_bytes(t))) for k, t in tensors.items()}


def test_dcp_streams_parts_and_mapped_bytes_and_takes_the_file_digest_as_written(tmp_path, copied):
    layers = [torch.randn(5, 3) for _ in range(4)]
    parts = Parts(layers)
    source = mapped_source(tmp_path, {"w": torch.randn(64, 32), "b": torch.arange(6.0)})
    state = {"stack": parts.lazy(), "w": source["w"], "nested": {"b": source["b"], "real": torch.ones(2)}, "obj": {"step": 3}}
    out = tmp_path / "dcp"
    with written_digests.digesting_as_written() as taken:
        write_dcp(state, str(out))
        data_file = out / "__0_0.distcp"
        assert taken.digest(str(data_file)) == digests.of_files([str(data_file)])[str(data_file)]
    assert parts.loaded == len(layers)
    assert sum(copied) == 64 * 32 * 4 + 6 * 4  # the mapped tensors' bytes were taken from their file
    back = {"stack": torch.zeros(4, 5, 3), "w": torch.zeros(64, 32), "nested": {"b": torch.zeros(6), "real": torch.zeros(2)}, "obj": {"step": 0}}
    load_dcp(back, str(out))
    assert torch.equal(back["stack"], torch.stack(layers))
    assert torch.equal(back["w"], source["w"].load()) and torch.equal(back["nested"]["b"], torch.arange(6.0))
    assert torch.equal(back["nested"]["real"], torch.ones(2)) and back["obj"]["step"] == 3


def test_dcp_stream_checks_mapped_bytes_against_their_digest(tmp_path):
    source = mapped_source(tmp_path, {"w": torch.randn(64, 32)})
    path = source["w"].origin.rsplit(":", 1)[0]
    flip_byte(path, -5)  # a byte of the tensor
    with pytest.raises(CorruptCheckpointError, match="source.safetensors:w.*differ from the digest"):
        write_dcp({"w": source["w"]}, str(tmp_path / "dcp"))


@pytest.mark.parametrize("layers, error", [
    ([torch.randn(5, 3), torch.randn(4, 3)], r"layer: is float32\[4, 3\], not a part of stacked \(float32\[2, 5, 3\]\)"),
    ([torch.randn(5, 3)], r"stacked: its parts hold 60 bytes; float32\[2, 5, 3\] is 120"),
    ([torch.randn(5, 3), torch.randn(5, 3).double()], r"layer: is float64\[5, 3\], not a part of stacked"),
], ids=["short-layer", "missing-layer", "other-dtype"])
def test_parts_that_do_not_make_up_the_tensor_are_an_error_not_a_wrong_record(tmp_path, layers, error):
    lazy = dataclasses.replace(Parts(layers).lazy(), spec=TensorSpec((2, 5, 3), torch.float32))
    with pytest.raises(CorruptCheckpointError, match=error):
        write_dcp({"stack": lazy}, str(tmp_path / "dcp"))


def test_any_object_is_saved_as_torch_save_saves_it_and_its_digest_is_taken_as_written(tmp_path):
    """save_torch (every pickled engine file we write): torch's own pickling, our records. Views sharing a storage,
    a non-contiguous view, a Parameter, numpy, a Namespace: the same file as torch.save's, but the id."""
    import argparse
    import collections

    import numpy as np


    base = torch.randn(10, 8)
    obj = {"model": collections.OrderedDict(a=torch.randn(3, 4).bfloat16(), b=base[2:5], c=base[:, 1], d=torch.arange(5)),
           "args": argparse.Namespace(x=1, y="s"), "np": np.arange(3.0), "rng": torch.get_rng_state(),
           "list": [1, 2.5, None, (3, "x")], "empty": torch.empty(0), "p": torch.nn.Parameter(torch.ones(2))}
    mine = saved_as_torch_saves(tmp_path, "model_optim_rng.pt", obj, obj)
    back = torch.load(mine, weights_only=False)
    assert torch.equal(back["model"]["b"], base[2:5]) and back["model"]["c"].stride() == (8,) and back["args"].y == "s"


def test_lazy_leaves_stream_into_the_file_torch_save_writes_for_the_loaded_object(tmp_path, copied):
    """A LazyTensor anywhere in the object is saved as the tensor it loads to (the same file as torch.save of the
    loaded object, storages numbered as torch numbers them): a mapped one copied file to file and its digest checked,
    a stack written layer by layer and never built; the same LazyTensor twice is one storage, as a tensor twice is."""

    layers = [torch.randn(5, 3) for _ in range(3)]
    parts = Parts(layers)
    source = mapped_source(tmp_path, {"w": torch.randn(64, 32), "b": torch.arange(6.0)})
    real = torch.randn(4)
    lazy_obj = {"a": real, "w": source["w"], "again": source["w"], "nested": [{"stack": parts.lazy()}, source["b"]], "step": 7,
                "none": LazyTensor.of(torch.empty(0, 3))}
    loaded = {"a": real, "w": source["w"].load(), "nested": [{"stack": torch.stack(layers)}, source["b"].load()], "step": 7,
              "none": torch.empty(0, 3)}
    loaded["again"] = loaded["w"]
    loaded = {k: loaded[k] for k in lazy_obj}  # the same key order
    mine = saved_as_torch_saves(tmp_path, "optim.pt", lazy_obj, loaded)
    assert parts.loaded == len(layers) and sum(copied) == (64 * 32 + 6) * 4
    back = torch.load(mine, weights_only=True)
    assert back["again"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()
    assert torch.equal(back["nested"][0]["stack"], torch.stack(layers)) and torch.equal(back["w"], loaded["w"])


def test_a_lazy_leaf_whose_source_changed_is_refused_naming_it(tmp_path):
    from converters.pickle_safety import save_torch

    source = mapped_source(tmp_path, {"w": torch.randn(64, 32)})
    path = source["w"].origin.rsplit(":", 1)[0]
    flip_byte(path, -5)
    with pytest.raises(CorruptCheckpointError, match="source.safetensors:w.*differ from the digest"):
        save_torch({"w": source["w"]}, str(tmp_path / "out.pt"))


def test_slices_and_leading_views_stream_as_torch_save_writes_the_loaded_object(tmp_path):
    """A ZeRO partition as the writers build it: slices of sources' flattened tensors and zeros, concatenated, and a
    view of its leading elements (torch_save.Leading, the partition without its padding) sharing its storage: the
    file torch.save writes for the loaded tensors; the sources' mapped bytes copied; a source whose bytes changed
    since its digest was recorded is refused before any slice of it is written."""
    from converters.pickle_safety import save_torch
    from interop.tensors import concat, zeros

    w, b = torch.randn(8, 5), torch.randn(7)
    source = mapped_source(tmp_path, {"w": w, "b": b})
    partition = concat([source["w"].flat_slice(12, 40), source["b"].flat_slice(0, 7), zeros(5, "float32")], "float32", "rank 0")
    loaded = torch.cat([w.reshape(-1)[12:40], b, torch.zeros(5)])
    mine = saved_as_torch_saves(tmp_path, "optim.pt", {"flat": torch_save.Leading(partition, 35), "states": [partition]},
                                {"flat": loaded[:35], "states": [loaded]})
    back = torch.load(mine, weights_only=True)
    assert torch.equal(back["states"][0], loaded) and back["flat"].untyped_storage().data_ptr() == back["states"][0].untyped_storage().data_ptr()

    path, offset, _ = source["w"].mapped_pieces()[0].source
    flip_byte(path, offset + 30 * 4)  # element 30 of w: outside the slice written, but the whole tensor's digest fails
    again = dataclasses.replace(source["w"])  # (a LazyTensor checks its digest once: this one has not)
    with pytest.raises(CorruptCheckpointError, match="source.safetensors:w.*differ from the digest"):
        save_torch({"flat": again.flat_slice(0, 4)}, str(tmp_path / "bad.pt"))
