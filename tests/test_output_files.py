"""Large output files written with direct I/O: the bytes (and digests) of the same file written through the page
cache, whichever way each buffer went; a failed write or a shortened source is one error naming the file."""

import errno
import os
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from interop import output_files, safetensors_io
from interop.errors import CorruptCheckpointError, OutputWriteError
from interop.safetensors_io import SafetensorsFile, TensorEntry, write_safetensors
from interop.tensors import LazyTensor
from tests.conftest import flip_byte


def takes_direct_io(directory) -> bool:
    """Whether the filesystem under ``directory`` opens files for direct I/O (tmpfs and some others do not)."""
    probe = os.path.join(directory, "probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.remove(probe)
    return True


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(5000, 3, generator=g), "empty": torch.zeros(0, 4), "half": torch.randn(1001, generator=g).half(),
            "ints": torch.arange(2049, dtype=torch.int64), "tiny": torch.ones(1)}


def entries(tmp_path, mapped: set[str]) -> list[TensorEntry]:
    """The tensors, those named in ``mapped`` as views of a stored file (read from it), the rest from memory."""
    source = tmp_path / "source.safetensors"
    if not source.exists():
        write_safetensors(source, [TensorEntry(n, LazyTensor.of(t).spec, lambda t=t: t) for n, t in tensors().items()])
    stored = SafetensorsFile(source)
    out = []
    for name, t in tensors().items():
        lazy = stored.lazy(name) if name in mapped else LazyTensor.of(t)
        out.append(TensorEntry(name, lazy.spec, lazy.load, lazy.mapped_pieces))
    return out


@pytest.fixture
def small_chunks(monkeypatch):
    """Direct writes for a file of any size, in buffers of three blocks: a tensor spans buffers, a buffer tensors."""
    monkeypatch.setattr(output_files, "DIRECT_FROM", 0)
    monkeypatch.setattr(output_files, "CHUNK", 3 * output_files.ALIGN)


def test_a_file_written_direct_is_the_file_written_through_the_page_cache(tmp_path, monkeypatch):
    reference = write_safetensors(tmp_path / "buffered.safetensors", entries(tmp_path, {"big", "ints"}), {"format": "pt"})
    opened = []

    def spy(path, size):
        opened.append(output_files.open_output(path, size))
        return opened[-1]

    monkeypatch.setattr(safetensors_io, "open_output", spy)
    monkeypatch.setattr(output_files, "DIRECT_FROM", 0)
    monkeypatch.setattr(output_files, "CHUNK", 3 * output_files.ALIGN)
    for mapped in ({"big", "ints"}, set(tensors()), set()):
        written = write_safetensors(tmp_path / "direct.safetensors", entries(tmp_path, mapped), {"format": "pt"})
        assert opened[-1].direct == takes_direct_io(tmp_path)  # direct where the filesystem takes it, from start to end
        assert (tmp_path / "direct.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()
        assert (written.nbytes, written.digest, written.tensor_digests) == (reference.nbytes, reference.digest, reference.tensor_digests)
    loaded = load_file(tmp_path / "direct.safetensors")
    assert all(torch.equal(loaded[n], t) for n, t in tensors().items())


def test_a_large_copy_into_the_write_buffers_lets_the_gil_go(tmp_path, monkeypatch):
    """A background commit copies a staged state into the write buffers beside a training thread: each copy of
    UNLOCKED_COPY or more goes through ctypes.memmove, which releases the GIL (a slice assignment holds it), and the
    file is byte for byte the one written without it; a read-only source is copied as a slice."""
    monkeypatch.setattr(output_files, "DIRECT_FROM", 0)
    monkeypatch.setattr(output_files, "CHUNK", 3 * output_files.ALIGN)
    monkeypatch.setattr(output_files, "UNLOCKED_COPY", 1 << 40)  # every copy a slice assignment
    reference = write_safetensors(tmp_path / "slices.safetensors", entries(tmp_path, set()), {"format": "pt"})
    monkeypatch.setattr(output_files, "UNLOCKED_COPY", 4096)
    unlocked, memmove = [], output_files.ctypes.memmove

    def counted(dst, src, n):
        unlocked.append(n)
        return memmove(dst, src, n)

    monkeypatch.setattr(output_files.ctypes, "memmove", counted)
    written = write_safetensors(tmp_path / "unlocked.safetensors", entries(tmp_path, set()), {"format": "pt"})
    assert unlocked and min(unlocked) >= 4096 and max(unlocked) <= 3 * output_files.ALIGN
    assert (tmp_path / "unlocked.safetensors").read_bytes() == (tmp_path / "slices.safetensors").read_bytes()
    assert written.digest == reference.digest
    into, source = bytearray(8192), bytes(range(256)) * 32
    unlocked.clear()
    output_files.copy_into(memoryview(into), memoryview(source))  # read-only: no address to hand memmove
    assert into == source and not unlocked
    output_files.copy_into(memoryview(into), memoryview(bytearray(source[::-1])))
    assert into == source[::-1] and unlocked == [8192]
    with pytest.raises(ValueError, match="8192 bytes to fill from 4096"):
        output_files.copy_into(memoryview(into), memoryview(bytearray(4096)))
    unlocked.clear()
    strided = bytearray(range(256)) * 64  # every other byte of it: no single run for memmove
    output_files.copy_into(memoryview(into), memoryview(strided)[::2])
    assert into == strided[::2] and not unlocked
    words = bytearray(8192)  # as 4-byte items: a copy of items, not of their count in bytes
    output_files.copy_into(memoryview(words).cast("I"), memoryview(bytearray(source)).cast("I"))
    assert words == source and not unlocked
    source_buffer = bytearray(source[::-1])
    output_files.copy_into(memoryview(into), memoryview(source_buffer))
    source_buffer.append(0)  # no export outlives the copy: the source can be resized


@pytest.mark.parametrize("direct", [True, False])
def test_a_hashed_write_reads_each_source_byte_once(tmp_path, monkeypatch, direct):
    """A universal output's tensor digests are taken where the output file has the bytes (in its buffers), so a
    mapped source's bytes are read from their file once, for the write and the hash both (twice before: the hash
    read them again); the digests are those of the file written, read back."""
    source = str(tmp_path / "source.safetensors")
    pieces = entries(tmp_path, {"big", "half", "ints"})
    mapped = sum(tensors()[n].nbytes for n in ("big", "half", "ints"))
    if direct:
        monkeypatch.setattr(output_files, "DIRECT_FROM", 0)
        monkeypatch.setattr(output_files, "CHUNK", 3 * output_files.ALIGN)
    else:
        monkeypatch.setattr(output_files, "DIRECT_FROM", 1 << 40)
    read_from_source = []
    preadv, copy_file_range = os.preadv, os.copy_file_range

    def of_source(fd: int, n: int) -> int:
        if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(source):
            read_from_source.append(n)
        return n

    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: of_source(fd, preadv(fd, buffers, offset)))
    monkeypatch.setattr(os, "copy_file_range", lambda src, dst, count, *a: of_source(src, copy_file_range(src, dst, count, *a)))
    written = write_safetensors(tmp_path / "out.safetensors", pieces, hashed=True)
    monkeypatch.undo()
    assert sum(read_from_source) == mapped
    assert (written.digest, written.tensor_digests) == safetensors_io.safetensors_digests(tmp_path / "out.safetensors")


def test_a_small_file_goes_through_the_page_cache(tmp_path):
    """Below DIRECT_FROM a file gains nothing from direct I/O, and whoever reads it next finds it in memory."""
    out = output_files.open_output(str(tmp_path / "small"), output_files.DIRECT_FROM - 1)
    try:
        assert isinstance(out, output_files.BufferedFile)
    finally:
        out.close()


def _refusing(monkeypatch, tmp_path, after: int, code: int) -> list[int]:
    """Writers given a DirectFile on an ordinary descriptor, whose direct writes are refused (``code``) once
    ``after`` of them have gone through; the direct writes tried, by descriptor."""
    real, direct, tried = output_files.pwrite_all, [], []

    def pwrite_all(fd, view, offset):
        if fd in direct:
            tried.append(fd)
            if len(tried) > after:
                raise OSError(code, os.strerror(code))
        real(fd, view, offset)

    def open_output(path, size):
        plain = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        direct.append(os.open(path, os.O_WRONLY))  # direct or not, the writer takes it as direct
        return output_files.DirectFile(path, size, plain, direct[-1])

    monkeypatch.setattr(output_files, "pwrite_all", pwrite_all)
    monkeypatch.setattr(output_files, "IN_FLIGHT", 1)  # one write at a time: which one is refused is certain
    monkeypatch.setattr(safetensors_io, "open_output", open_output)
    return tried


def test_a_device_that_refuses_direct_writes_midway_gets_the_same_file(tmp_path, monkeypatch, small_chunks):
    """EINVAL from a direct write (an alignment the device will not take): that buffer and every one after it go
    through the page cache; the file is the same."""
    reference = write_safetensors(tmp_path / "reference.safetensors", entries(tmp_path, {"big"}))
    tried = _refusing(monkeypatch, tmp_path, after=2, code=errno.EINVAL)
    written = write_safetensors(tmp_path / "out", entries(tmp_path, {"big"}))
    assert written.nbytes == reference.nbytes and written.digest == reference.digest
    assert (tmp_path / "out").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert len(tried) == 3  # two writes went direct, the third was refused, and none was tried direct after it


def test_a_direct_write_that_fails_is_one_error_naming_the_file(tmp_path, monkeypatch, small_chunks):
    pieces = entries(tmp_path, {"big"})
    _refusing(monkeypatch, tmp_path, after=1, code=errno.ENOSPC)
    with pytest.raises(OutputWriteError, match=f"{tmp_path / 'out'}: could not be written: No space left on device"):
        write_safetensors(tmp_path / "out", pieces)


@pytest.mark.parametrize("direct", [True, False])
def test_a_source_shortened_while_it_is_read_is_named(tmp_path, small_chunks, direct):
    """A mapped source file cut short after its pieces were taken: their bytes are read (or copied in the kernel)
    from the file, which ends early; the error names the source, not the output, and the mapping, which would
    fault, is never touched."""
    entries(tmp_path, set())
    pieces = SafetensorsFile(tmp_path / "source.safetensors").mapped("big")
    os.truncate(tmp_path / "source.safetensors", 1000)
    path = str(tmp_path / "out")
    out = (output_files.DirectFile(path, 1 << 20, os.open(path, os.O_WRONLY | os.O_CREAT), os.open(path, os.O_WRONLY))
           if direct else output_files.BufferedFile(path))
    with pytest.raises(CorruptCheckpointError, match=f"{tmp_path / 'source.safetensors'}: ended .* bytes early"):
        with output_files.closing(out, path):
            for piece in pieces:
                out.write_piece(piece)


def test_a_source_replaced_since_it_was_mapped_is_written_from_the_mapping(tmp_path, small_chunks):
    """The bytes written are the mapped (and hashed) ones, not those of a file put in the source's place."""
    reference = write_safetensors(tmp_path / "reference.safetensors", entries(tmp_path, set()))
    stored = SafetensorsFile(tmp_path / "source.safetensors")
    mapped = {n: stored.mapped(n) for n in tensors()}  # the file mapped now
    pieces = [TensorEntry(n, stored.spec(n), stored.lazy(n).load, lambda n=n: mapped[n]) for n in tensors()]
    replacement = tmp_path / "other"
    replacement.write_bytes(b"\0" * (tmp_path / "source.safetensors").stat().st_size)
    os.replace(replacement, tmp_path / "source.safetensors")
    written = write_safetensors(tmp_path / "out.safetensors", pieces)
    assert written.digest == reference.digest
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def mapped_with_digests(tmp_path, named: dict[str, torch.Tensor]) -> dict[str, LazyTensor]:
    """Tensors stored in a safetensors file, as mapped LazyTensors with their digests recorded (a universal source's)."""
    import dataclasses

    from safetensors.torch import save_file

    from interop import digests
    from interop.tensors import raw_bytes

    save_file(named, str(tmp_path / "mapped.safetensors"))
    stored = SafetensorsFile(tmp_path / "mapped.safetensors")
    return {k: dataclasses.replace(stored.lazy(k), digest=digests.of_bytes(raw_bytes(t))) for k, t in named.items()}


def test_a_file_of_unknown_size_goes_direct_once_it_is_large(tmp_path, monkeypatch, small_chunks):
    """A torch.save archive (its size known only at its end) is written through the page cache up to DIRECT_FROM
    and direct after, where the filesystem takes it: the file and the digest taken as it was written are those
    of the same archive written through the page cache. A mapped source's tensor (spanning buffers) is read from
    its file into the buffers, and its CRC, the file's digest and the source's digest check all take it there."""
    from converters.pickle_safety import save_torch
    from interop import digests, hashed_writes, written_digests

    g = torch.Generator().manual_seed(1)
    named = {"m": torch.randn(200, 67, generator=g), "tail": torch.randn(3, generator=g)}
    mapped = mapped_with_digests(tmp_path, named)
    state = {"w": torch.randn(300, 41), "step": 7, "nested": {"b": torch.arange(5000, dtype=torch.int64)}, "m": mapped["m"],
             "again": mapped["m"], "tail": mapped["tail"]}
    monkeypatch.setattr(output_files, "DIRECT_FROM", 1 << 40)
    (tmp_path / "buffered").mkdir()
    (tmp_path / "direct").mkdir()
    save_torch(state, str(tmp_path / "buffered" / "state.pt"))  # (torch.save names the archive inside after the file)
    monkeypatch.setattr(output_files, "DIRECT_FROM", 4 * output_files.CHUNK)
    opened = []

    def spy(path, size=None):
        opened.append(output_files.open_output(path, size))
        return opened[-1]

    monkeypatch.setattr(hashed_writes, "open_output", spy)
    with written_digests.digesting_as_written() as taken:
        save_torch(state, str(tmp_path / "direct" / "state.pt"))
        path = str(tmp_path / "direct" / "state.pt")
        assert taken.digest(path) == digests.of_files([path])[path]
    assert opened[-1].direct == takes_direct_io(tmp_path)
    assert (tmp_path / "direct" / "state.pt").read_bytes() == (tmp_path / "buffered" / "state.pt").read_bytes()
    back = torch.load(tmp_path / "direct" / "state.pt", weights_only=True)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["nested"]["b"], state["nested"]["b"]) and back["step"] == 7
    assert torch.equal(back["m"], named["m"]) and torch.equal(back["again"], named["m"]) and torch.equal(back["tail"], named["tail"])
    with zipfile.ZipFile(tmp_path / "direct" / "state.pt") as archive:
        assert archive.testzip() is None  # every record's CRC (the mapped tensor's taken from the buffers it was read into)
    flip_byte(str(tmp_path / "mapped.safetensors"), -100)  # a byte of "m", after its digest was recorded
    with pytest.raises(CorruptCheckpointError, match="mapped.safetensors:m: .*differ from the digest"):
        save_torch(state, str(tmp_path / "direct" / "again.pt"))


def test_a_filesystem_without_direct_io_gets_the_page_cache(tmp_path, monkeypatch, small_chunks):
    """Opening for direct I/O refused (EINVAL, as tmpfs before Linux 6.6 and some FUSE filesystems answer): a file of
    known size is written through the page cache from the start, one of unknown size stays there past the mark;
    the files are the same."""
    from converters.pickle_safety import save_torch
    from interop import hashed_writes

    reference = write_safetensors(tmp_path / "reference.safetensors", entries(tmp_path, {"big"}))
    state = {"w": torch.randn(300, 41), "b": torch.arange(5000, dtype=torch.int64)}
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
    save_torch(state, str(tmp_path / "one" / "state.pt"))
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    opened = []

    def spy(path, size=None):
        opened.append(output_files.open_output(path, size))
        return opened[-1]

    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(safetensors_io, "open_output", spy)
    monkeypatch.setattr(hashed_writes, "open_output", spy)
    written = write_safetensors(tmp_path / "out.safetensors", entries(tmp_path, {"big"}))
    save_torch(state, str(tmp_path / "two" / "state.pt"))
    assert isinstance(opened[0], output_files.BufferedFile) and isinstance(opened[1], output_files.GrowingFile)
    assert not opened[1].direct and opened[1].tell() > output_files.DIRECT_FROM
    assert written.digest == reference.digest
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert (tmp_path / "two" / "state.pt").read_bytes() == (tmp_path / "one" / "state.pt").read_bytes()


@pytest.mark.parametrize("size", [100, 64 << 20])
def test_a_file_given_fewer_bytes_than_its_size_is_refused(tmp_path, size):
    """A writer that hands over fewer bytes than it opened the file for (a preallocated direct file would look
    whole): refused at sync, naming the file, however it was written."""
    path = str(tmp_path / "short")
    with pytest.raises(OutputWriteError, match=f"{path}: was given 50 bytes for its {size}"):
        with output_files.closing(output_files.open_output(path, size), path) as out:
            out.write(b"x" * 50)
            out.sync()


SHORTENED_AND_HASHED = """
import os, sys
import torch
from interop.errors import CorruptCheckpointError
from interop.safetensors_io import SafetensorsFile, TensorEntry, write_safetensors
from interop.tensors import LazyTensor

src, out = sys.argv[1], sys.argv[2]
write_safetensors(src, [TensorEntry("big", LazyTensor.of(torch.randn(300, 512)).spec, lambda: torch.randn(300, 512))])
stored = SafetensorsFile(src)
mapped = stored.mapped("big")  # the file mapped now, then cut short: its mapping would fault past the cut
os.truncate(src, 4096)
try:
    write_safetensors(out, [TensorEntry("big", stored.spec("big"), stored.lazy("big").load, lambda: mapped)], hashed=True)
except CorruptCheckpointError as exc:
    print(exc)
"""


def test_a_source_shortened_under_a_hashed_write_is_named_not_a_crash(tmp_path):
    """A universal output hashes each tensor as it writes it: a mapped source's bytes are hashed from its file, so a
    source cut short since it was mapped is one error naming it (hashing its mapping would kill the process with
    SIGBUS). In a child process: were the mapping read, the signal would take the test run with it."""
    import subprocess
    import sys

    from tests.conftest import worker_env

    src = str(tmp_path / "source.safetensors")
    result = subprocess.run([sys.executable, "-c", SHORTENED_AND_HASHED, src, str(tmp_path / "out.safetensors")],
                            env=worker_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.startswith(f"{src}: ended ") and "bytes early" in result.stdout, result.stdout


SHORTENED_UNDER_TORCH_SAVE = """
import os, sys, dataclasses
import torch
from safetensors.torch import save_file
from converters.dcp import write_dcp
from converters.pickle_safety import save_torch
from interop import digests, output_files
from interop.errors import CorruptCheckpointError
from interop.safetensors_io import SafetensorsFile
from interop.tensors import raw_bytes

src, out, writer, direct = sys.argv[1:5]
if direct == "direct":
    output_files.DIRECT_FROM, output_files.CHUNK = 0, 3 * output_files.ALIGN
w = torch.randn(300, 512)
save_file({"w": w}, src)
stored = SafetensorsFile(src)
lazy = dataclasses.replace(stored.lazy("w"), digest=digests.of_bytes(raw_bytes(w)))
stored.mapped("w")  # the file mapped now, then cut short: its mapping would fault past the cut
os.truncate(src, 4096)
try:
    save_torch({"w": lazy}, out) if writer == "torch.save" else write_dcp({"w": lazy}, out)
except CorruptCheckpointError as exc:
    print(exc)
"""


@pytest.mark.parametrize("writer", ["torch.save", "dcp"])
@pytest.mark.parametrize("direct", ["direct", "buffered"])
def test_a_source_shortened_under_a_torch_save_write_is_named_not_a_crash(tmp_path, writer, direct):
    """The torch.save writers (DeepSpeed, Megatron, DCP, ds-universal targets) read a mapped source's bytes from its
    file into the buffer they write from, and take the CRC and the source's and the output's digests there: a
    source cut short since it was mapped is one error naming it. The CRC and the hashes read the mapping before,
    and the process died of SIGBUS (in a child process here: the signal would take the test run with it)."""
    import subprocess
    import sys

    from tests.conftest import worker_env

    src = str(tmp_path / "source.safetensors")
    result = subprocess.run([sys.executable, "-c", SHORTENED_UNDER_TORCH_SAVE, src, str(tmp_path / "out"), writer, direct],
                            env=worker_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.startswith(f"{src}: ended ") and "bytes early" in result.stdout, result.stdout


SHORTENED_UNDER_A_READ = """
import dataclasses, errno, io, os, sys
import torch
from safetensors.torch import save_file
from converters import torch_save, torch_zip
from interop import digests
from interop.safetensors_io import SafetensorsFile, TensorEntry, write_safetensors
from interop.tensors import raw_bytes

src, pt, out = sys.argv[1:4]
w = torch.randn(300, 512)
save_file({"w": w}, src)
torch.save({"w": w}, pt)
stored = SafetensorsFile(src)
checked = dataclasses.replace(stored.lazy("w"), digest=digests.of_bytes(raw_bytes(w)))
plain = stored.lazy("w")
stand_in = torch_zip.load(pt)["w"]
stored.mapped("w"), stand_in.piece()  # the files mapped now, then cut short: their mappings would fault past the cut
os.truncate(src, 4096)
os.truncate(pt, 4096)


def copy_refused(*args):  # as from another filesystem on an older kernel: the bytes are written the ordinary way
    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))


os.copy_file_range = copy_refused
reads = [("digest", checked.bytes_digest), ("slice", lambda: plain.flat_slice(0, 150_000).load()),
         ("torch.save", lambda: torch_save.save({"w": plain}, io.BytesIO(), "archive")),
         ("stand-in", lambda: torch_zip.copy_into(torch.empty(300, 512), stand_in)),
         ("copied", lambda: write_safetensors(out, [TensorEntry("w", plain.spec, plain.load, plain.mapped_pieces)], hashed=False))]
"""


def test_a_source_shortened_under_any_other_read_of_its_bytes_is_named_not_a_crash(tmp_path):
    """A tensor's digest taken from its mapped pieces (a tied pair's comparison, a slice's check of the whole), a
    slice's bytes, torch.save into a file that does not read sources itself, a torch file's stand-in copied into a
    tensor, and a write whose file-to-file copy the kernel refused are read from the source's file: one error naming
    it for each, where each read its mapping and the process died of SIGBUS (in a child process here: the signal
    would take the test run with it)."""
    from tests.conftest import reads_in_a_child

    src, pt = str(tmp_path / "source.safetensors"), str(tmp_path / "source.pt")
    said = reads_in_a_child(SHORTENED_UNDER_A_READ, src, pt, str(tmp_path / "out.safetensors"))
    assert [what for what, _ in said] == ["digest", "slice", "torch.save", "stand-in", "copied"], said
    for what, message in said:
        assert message.startswith(f"{pt if what == 'stand-in' else src}: ended ") and "bytes early" in message, (what, message)


def test_a_safetensors_writer_fetches_small_tensors_ahead_up_to_its_limit_and_a_large_one_alone(tmp_path, monkeypatch):
    """The tensors after the one being written are fetched (their source bytes checked) meanwhile, while those under
    way hold less than FETCH_AHEAD_BYTES: a run of small tensors has several fetched at once, never more than the
    limit allows, and one at least as large as the limit is fetched alone; the file is the one written one at a time."""
    import time

    from interop import safetensors_io
    from interop.safetensors_io import TensorEntry, write_safetensors
    from interop.tensors import LazyTensor

    tensors = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(8)}  # 1 MiB each
    tensors["big"] = torch.ones(1024, 1024 * 4)  # 16 MiB, then two more small ones
    tensors.update({f"u{i}": torch.full((256, 1024), -float(i)) for i in range(2)})
    names = list(tensors)
    entries = [TensorEntry(n, LazyTensor.of(t).spec, lambda t=t: t) for n, t in tensors.items()]
    monkeypatch.setattr(safetensors_io, "FETCH_AHEAD_BYTES", 1)  # the next tensor only, whatever its size
    reference = write_safetensors(tmp_path / "one_at_a_time.safetensors", entries)
    monkeypatch.setattr(safetensors_io, "FETCH_AHEAD_BYTES", 4 << 20)
    written, ahead = [], {}
    real = safetensors_io.fetch_pieces
    monkeypatch.setattr(safetensors_io, "fetch_pieces", lambda e: (ahead.__setitem__(e.name, names.index(e.name) - len(written)), real(e))[1])
    out = write_safetensors(tmp_path / "ahead.safetensors", entries,
                            on_tensor=lambda e: (time.sleep(0.05), written.append(e.name)))  # a slow writer: the fetches get ahead
    assert max(ahead.values()) == 4  # 1 MiB each, under way while less than 4 MiB is: four after the one being written
    assert ahead["u0"] == 1 and ahead["u1"] <= 2  # behind the 16 MiB tensor, nothing else was fetched
    assert (tmp_path / "ahead.safetensors").read_bytes() == (tmp_path / "one_at_a_time.safetensors").read_bytes()
    assert out.digest == reference.digest
