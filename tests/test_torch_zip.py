"""torch's zip files read without torch (converters.torch_zip): what it returns is what torch.load returns once
materialized, it never runs or builds more than torch's weights-only loader would, and damage is one error
naming the file."""

from __future__ import annotations

import collections
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch

from converters import pickle_safety, torch_zip
from converters.deepspeed import DEEPSPEED_ALLOWLIST, LossScaler
from interop.errors import CorruptCheckpointError, UnsafePickleError
from tests.architectures import ROOT


def same(a, b, where="") -> None:
    """Deep equality of what torch.load gives: types, tensors (dtype, shape, stride, values, requires_grad,
    class, attributes) and containers."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.requires_grad) == (b.dtype, b.shape, b.stride(), b.requires_grad), where
        assert torch.equal(a, b), where
        assert {k: v for k, v in vars(a).items()} == {k: v for k, v in vars(b).items()}, where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        assert getattr(a, "__dict__", {}).keys() == getattr(b, "__dict__", {}).keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        same(vars(a), vars(b), f"{where}.__dict__")
    else:
        assert a == b, where


def varied_state() -> dict:
    torch.manual_seed(0)
    base = torch.randn(6, 8)
    flat = torch.randn(100)
    flat.ds_id = "0_12"  # DeepSpeed tags its flat groups; torch pickles the attribute with the tensor
    module = torch.nn.Linear(4, 3).state_dict()  # an OrderedDict with _metadata: BUILD on an OrderedDict
    return {
        "module": module,
        "views": [base, base[2:5], base.t(), base[:, 1], base[1:, 2:].contiguous()],  # one storage, offsets, strides
        "dtype": torch.bfloat16,
        "dtypes": {str(d): torch.arange(7).to(d) for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                                       torch.int32, torch.int8, torch.uint8, torch.bool, torch.float64)},
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0, 5),
        "param": torch.nn.Parameter(torch.randn(3, 2)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "flat_groups": [flat, flat[10:20]],
        "shapes": collections.OrderedDict(a=torch.Size([3, 4]), b=torch.Size([])),
        "plain": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "x", "none": None, "flag": True, "big": 2**40},
    }


def test_materialized_stand_ins_are_what_torch_load_gives(tmp_path):
    state = varied_state()
    path = tmp_path / "state.pt"
    torch.save(state, path)
    stored = torch_zip.load(str(path), DEEPSPEED_ALLOWLIST)
    assert isinstance(stored["views"][1], torch_zip.StoredTensor) and stored["views"][1].storage_offset == 16
    assert stored["flat_groups"][0].attributes == (("ds_id", "0_12"),)
    expected = torch.load(path, weights_only=True)
    same(torch_zip.materialize(stored), expected)
    # the byte path: a contiguous view's piece is its bytes in the file; item() reads a scalar without torch
    piece = stored["views"][1].piece()
    assert bytes(piece.data) == base_bytes(state["views"][1]) and piece.source[0] == str(path)
    assert stored["scalar"].item() == 3.0
    assert stored["dtypes"]["torch.bfloat16"].dtype_name == "bfloat16"


def base_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_reading_needs_no_torch(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": torch.Size([3, 4])}, path)
    probe = ("import sys; sys.modules['torch'] = None\n"
             "from converters import torch_zip\n"
             f"o = torch_zip.load({str(path)!r})\n"
             "import struct; w = o['w']\n"
             "print(w.shape, w.dtype_name, struct.unpack('<12f', bytes(w.piece().data))[5], tuple(o['n']))")
    done = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(3, 4) float32 5.0 (3, 4)"


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _rewrite_pickle(src, dst, transform) -> None:
    """A copy of torch file ``src`` whose data.pkl is ``transform(data.pkl)``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info, transform(data) if info.filename.endswith("/data.pkl") else data)


def test_what_the_stand_ins_do_not_express_goes_to_torchs_weights_only_loader(tmp_path):
    """A global beyond the stand-ins is torch's to judge: refused (UnsafePickleError, naming the file) where
    torch refuses it, loaded by torch where the allowlist admits it."""
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Evil()}, evil)
    with pytest.raises(torch_zip.NeedsTorch, match="posix.system"):
        torch_zip.load(str(evil))
    with pytest.raises(UnsafePickleError, match="evil.pt"):
        pickle_safety.load_torch_file(str(evil), stored=True)
    # a sparse tensor: torch's loader admits it, the stand-ins leave it (and the whole file) to torch
    sparse = tmp_path / "sparse.pt"
    torch.save({"s": torch.eye(3).to_sparse(), "w": torch.ones(2)}, sparse)
    with pytest.raises(torch_zip.NeedsTorch):
        torch_zip.load(str(sparse))
    loaded = pickle_safety.load_torch_file(str(sparse), stored=True)
    assert loaded["s"].is_sparse and isinstance(loaded["w"], torch.Tensor)


def test_state_set_on_a_class_is_left_to_torch(tmp_path):
    """BUILD on a class object (a pickle trying to change an allowlisted class for the rest of the process):
    never run by the stand-ins; torch's loader refuses it."""
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, path)
    # GLOBAL LossScaler, a state dict, BUILD: sets attributes on the class itself
    name = f"{LossScaler.__module__}\n{LossScaler.__qualname__}\n".encode()
    attack = b"\x80\x02c" + name + b"}q\x00X\x03\x00\x00\x00pwnq\x01K\x01sb."
    bad = tmp_path / "bad.pt"
    _rewrite_pickle(path, bad, lambda _: attack)
    with pytest.raises(torch_zip.NeedsTorch):
        torch_zip.load(str(bad), [(LossScaler, f"{LossScaler.__module__}.{LossScaler.__qualname__}")])
    assert not hasattr(LossScaler, "pwn")


@pytest.mark.parametrize("damage", ["view-past-storage", "missing-storage", "truncated"])
def test_damage_is_one_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "state.pt"
    torch.save({"w": torch.arange(10, dtype=torch.float32)}, path)
    if damage == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(CorruptCheckpointError, match="state.pt"):
            torch_zip.load(str(path))
        return
    pkl = zipfile.ZipFile(path).read("state/data.pkl")
    if damage == "view-past-storage":
        # size (10,) -> (20,): the view runs 40 bytes past its storage
        new = pkl.replace(b"K\nK\x01", b"K\x14K\x01") if b"K\nK\x01" in pkl else pkl.replace(b"K\n\x85", b"K\x14\x85")
        assert new != pkl
        expect = "runs past storage"
    else:
        new = pkl.replace(b"X\x01\x00\x00\x000", b"X\x01\x00\x00\x007")  # storage key '0' -> '7'
        assert new != pkl
        expect = "does not hold"
    bad = tmp_path / "bad.pt"
    _rewrite_pickle(path, bad, lambda _: new)
    with pytest.raises(CorruptCheckpointError, match=expect) as err:
        torch_zip.load(str(bad))
    assert "bad.pt" in str(err.value)


def test_pickled_by_the_pure_python_pickler_too(tmp_path):
    """Protocol details torch does not pin (the C and Python picklers differ in memo opcodes) read the same."""
    obj = {"a": [1, 2, {"b": (3.5, None)}], "s": {1, 2}}
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(1)}, path)
    _rewrite_pickle(path, path.with_name("py.pt"), lambda _: pickle.dumps(obj, protocol=2))
    assert torch_zip.load(str(path.with_name("py.pt"))) == obj


def test_a_torch_file_inside_another_file_is_read_where_it_lies(tmp_path):
    """DCP keeps each tensor as a torch.save archive at an offset of its data file: read there, its tensors' bytes
    are the file's bytes at their offsets."""
    import io

    blob = io.BytesIO()
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    torch.save(t, blob)
    path = tmp_path / "data.distcp"
    path.write_bytes(b"x" * 1000 + blob.getvalue() + b"y" * 77)
    stored = torch_zip.load(str(path), base=1000, length=len(blob.getvalue()))
    assert stored.shape == (4, 6) and stored.dtype_name == "float32"
    piece = stored.piece()
    assert piece.source[1] >= 1000 and bytes(piece.data) == base_bytes(t)
    assert torch.equal(stored.tensor(), t)
    with pytest.raises(CorruptCheckpointError, match="data.distcp"):  # a window running past the file
        torch_zip.load(str(path), base=1000, length=len(blob.getvalue()) + 100)


def test_stand_ins_torch_would_build_otherwise_are_left_to_it(tmp_path):
    """A dict keyed by a dtype comes back keyed by the dtype; a pickled storage (not under a tensor) is torch's to
    load, never handed out as the reader's own record of it."""
    keyed = tmp_path / "keyed.pt"
    torch.save({"scale": {torch.float16: 1.0}, "w": torch.ones(2)}, keyed)
    assert torch_zip.materialize(torch_zip.load(str(keyed)))["scale"] == {torch.float16: 1.0}
    storage = tmp_path / "storage.pt"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; files still hold it
        torch.save({"s": torch.ones(3).storage()}, storage)
        with pytest.raises(torch_zip.NeedsTorch, match="storage outside a tensor"):
            torch_zip.load(str(storage))
        assert pickle_safety.load_torch_file(str(storage), stored=True)["s"].tolist() == [1.0, 1.0, 1.0]


def test_a_window_whose_zip_points_before_it_is_refused(tmp_path):
    """A DCP data file holds archives back to back; one whose zip directory offset is moved to point into the
    archive before it must not decode that archive's bytes as its own."""
    import io
    import struct

    def saved(v: float) -> bytearray:
        b = io.BytesIO()
        torch.save(torch.full((4,), v), b)
        return bytearray(b.getvalue())

    first, second = saved(1.0), saved(2.0)
    end64 = second.rfind(b"PK\x06\x06")
    if end64 >= 0:  # the zip64 end record's central directory offset
        struct.pack_into("<Q", second, end64 + 48, struct.unpack_from("<Q", second, end64 + 48)[0] + len(first))
    else:
        end = second.rfind(b"PK\x05\x06")
        struct.pack_into("<I", second, end + 16, struct.unpack_from("<I", second, end + 16)[0] + len(first))
    path = tmp_path / "data.distcp"
    path.write_bytes(bytes(first + second))
    with pytest.raises(CorruptCheckpointError, match="data.distcp"):
        torch_zip.load(str(path), base=len(first), length=len(second)).tensor()


def test_a_registration_replaced_stays_good_for_its_readers(tmp_path):
    """``interop diff X X`` registers X's files twice: the first reader's checks still read the right file."""
    from interop import digests, ranged
    from interop.manifest import FileRecord

    paths = [tmp_path / n for n in ("a", "b")]
    records = {}
    for p in paths:
        p.write_bytes(os.urandom(4096))
        found = digests.of_files([str(p)], blocked=True, block_bytes=1024)[str(p)]
        records[p] = FileRecord(4096, found.digest, blocks=found.blocks, block_bytes=1024)
    first = {p: ranged.defer(str(p), records[p]) for p in paths}
    for p in paths:
        ranged.defer(str(p), records[p])
    for p in paths:
        first[p].check(0, 4096, os.stat(p).st_ino)
        ranged.registered(str(p)).check(0, 4096, os.stat(p).st_ino)
    data = bytearray(paths[0].read_bytes())
    data[2000] ^= 1
    paths[0].write_bytes(bytes(data))
    ranged.defer(str(paths[0]), records[paths[0]])
    ranged.registered(str(paths[0])).check(0, 1024)  # the blocks a reader uses, and only those
    with pytest.raises(CorruptCheckpointError, match=r"bytes 1024\.\.2048 differ"):
        ranged.registered(str(paths[0])).check(1500, 1600)
    ranged.clear()
    assert ranged.registered(str(paths[0])) is None


def test_a_look_at_a_files_index_hashes_only_its_blocks_and_a_tensors_read_hashes_ahead(tmp_path):
    """Reading a torch file's directory and data.pkl checks just the blocks they lie in (the reader goes elsewhere
    next: a block hashed ahead there is a core taken from the blocks it does need); a tensor's bytes, read on in
    order, have the next blocks hashed meanwhile."""
    from interop import digests, ranged
    from interop.manifest import FileRecord

    path = tmp_path / "t.pt"
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, path)  # 16 KiB of storage between data.pkl and the directory
    block = 1024
    found = digests.of_files([str(path)], blocked=True, block_bytes=block)[str(path)]
    size = os.path.getsize(path)
    check = ranged.defer(str(path), FileRecord(size, found.digest, blocks=found.blocks, block_bytes=block))
    try:
        archive = torch_zip.Archive(str(path))
        looked = set(check._checks)
        pickle_block = archive._headers[next(n for n in archive.records if n.endswith("data.pkl"))][0] // block
        assert looked <= {pickle_block, pickle_block + 1, *range((size - 1024) // block - 1, size // block + 1)}
        start, nbytes = archive.storage("0", 4096 * 4)
        archive.checked_storage("0", start, start + block)
        assert {start // block + 1, start // block + 2} <= set(check._checks)  # hashed ahead of the tensor's reader
    finally:
        ranged.clear()


def test_the_end_of_a_command_drops_block_checks_not_yet_begun_and_a_reader_still_gets_its_bytes_checked(tmp_path, monkeypatch):
    """Blocks hashed ahead for a use that never comes (a reader's first weight, started while it plans, under a
    command that only inspects) are dropped unstarted by ``ranged.clear`` at the end of the command, not hashed
    before the process may exit; a reader that still holds the check has each block it asks for checked anew."""
    import threading

    from interop import digests, ranged
    from interop.manifest import FileRecord

    path, block = tmp_path / "data.bin", 1024
    path.write_bytes(os.urandom(16 * block))
    found = digests.of_files([str(path)], blocked=True, block_bytes=block)[str(path)]
    check = ranged.defer(str(path), FileRecord(16 * block, found.digest, blocks=found.blocks, block_bytes=block))
    hashed = []
    real = ranged.RangeCheck._check_block
    monkeypatch.setattr(ranged.RangeCheck, "_check_block", lambda self, i: (hashed.append(i), real(self, i))[1])
    gate = threading.Event()
    held = [ranged._pool().submit(gate.wait) for _ in range(ranged._pool()._max_workers)]  # every checking thread busy
    try:
        check.start(0, 16 * block)
        ranged.clear()
    finally:
        gate.set()
    for f in held:
        f.result(timeout=60)
    assert all(f.cancelled() for f in check._checks.values()) and hashed == []
    data = bytearray(path.read_bytes())
    data[5 * block + 7] ^= 1
    path.write_bytes(bytes(data))  # (same inode: as the reader opened it)
    check.check(0, 2 * block, ahead=False)
    with pytest.raises(CorruptCheckpointError, match=r"bytes 5120\.\.6144 differ"):
        check.check(5 * block, 5 * block + 8, ahead=False)
    assert hashed == [0, 1, 5]


def test_numpys_rng_state_is_read_without_torch_its_types_imported_when_named(tmp_path):
    """A pickle holding ``np.random.get_state()`` (accelerate's and Megatron's RNG files) is read by the torch-free
    reader with the lazy numpy allowlist: the names resolve to numpy's own types when the pickle names them."""
    import numpy as np

    from converters.pickle_safety import numpy_allowlist

    state = np.random.RandomState(3).get_state()
    path = tmp_path / "rng.pt"
    torch.save({"numpy": state, "w": torch.arange(3.0)}, path)
    got = torch_zip.load(str(path), numpy_allowlist())  # (NeedsTorch if a name did not resolve)
    assert got["numpy"][0] == state[0] and np.array_equal(got["numpy"][1], state[1]) and got["numpy"][2:] == state[2:]
    assert torch.equal(torch_zip.as_torch(got["w"]), torch.arange(3.0))


def test_weights_only_loads_on_two_threads_keep_each_ones_allowlist(tmp_path, monkeypatch):
    """torch's safe_globals is one set for the process, each load's entries taken out as it leaves: a load that
    leaves while another is inside took the entries both were given (every rank's file is loaded with the same
    allowlist) away from the other (ranks' files are parsed side by side). Loads through torch take turns: the
    second load, whose file holds an allowlisted object, still reads it after the first has left."""
    import fractions
    import threading
    import time

    from converters.pickle_safety import load_torch_file

    plain, needs = tmp_path / "plain.pt", tmp_path / "ratio.pt"
    torch.save({"w": torch.ones(2)}, plain)
    torch.save({"ratio": fractions.Fraction(1, 3)}, needs)  # (a type no library allowlists for the whole process)
    real = torch.load

    def slow(*args, **kwargs):  # inside safe_globals long enough for the other thread's to come and go
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", slow)
    results = {}

    def load(name, path, allow):
        try:
            results[name] = load_torch_file(str(path), allow=allow)
        except Exception as exc:  # noqa: BLE001
            results[name] = exc

    first = threading.Thread(target=load, args=("plain", plain, [fractions.Fraction]))  # one allowlist for all ranks' files
    second = threading.Thread(target=load, args=("ratio", needs, [fractions.Fraction]))
    first.start()
    time.sleep(0.1)
    second.start()
    first.join()
    second.join()
    assert torch.equal(results["plain"]["w"], torch.ones(2))
    assert not isinstance(results["ratio"], Exception), results["ratio"]
    assert results["ratio"]["ratio"] == fractions.Fraction(1, 3)
