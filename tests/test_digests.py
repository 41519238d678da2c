"""Which digests a checkpoint gets: XXH3-128 by default, BLAKE3 or sha256 where INTEROP_DIGEST asks, each checked
by its own algorithm whatever wrote it; and ``interop diff`` compares bytes, not the manifests' word."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from converters.diff import _compare
from interop import digests
from interop.tensors import LazyTensor, TensorSpec
from tests.architectures import ROOT, saved


def _convert(src, dst, fmt: str, algo: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(digests.DIGEST_ENV, None)
    if algo is not None:
        env[digests.DIGEST_ENV] = algo
    return subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(src), str(dst), "--to", fmt],
                          env=env, capture_output=True, text=True, timeout=300)


def _algorithms(directory) -> set[str]:
    manifest = json.loads((directory / "manifest.json").read_text())
    found = {digests.parse(r["digest"])[0] for r in manifest["files"].values()}
    found |= {digests.parse(t["digest"])[0] for t in manifest.get("tensors", {}).values() if t.get("digest")}
    return found


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_new_digests_are_xxh128_and_each_algorithm_checks_what_it_wrote(tmp_path):
    """A default conversion records xxh128 digests; INTEROP_DIGEST=blake3 records blake3 ones. Either checkpoint
    converts onward under the other setting (its digests checked by their own algorithm), and a byte flipped in
    either's tensor data is refused, naming the file."""
    _, src = saved(tmp_path, "llama")
    for algo, setting, other in (("xxh128", None, "blake3"), ("blake3", "blake3", None)):
        uni = tmp_path / f"uni-{algo}"
        done = _convert(src, uni, "universal", setting)
        assert done.returncode == 0, done.stderr
        assert _algorithms(uni) == {algo}
        onward = _convert(uni, tmp_path / f"again-{algo}", "universal", other)
        assert onward.returncode == 0, onward.stderr
        assert _algorithms(tmp_path / f"again-{algo}") == {other or "xxh128"}
        shard = next((uni / "model").glob("*.safetensors"))
        _flip(shard, shard.stat().st_size - 7)
        refused = _convert(uni, tmp_path / f"hf2-{algo}", "hf", other)
        assert refused.returncode == 2 and shard.name in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
        assert not (tmp_path / f"hf2-{algo}").exists()


def test_an_unknown_digest_setting_is_one_line_and_writes_nothing(tmp_path):
    _, src = saved(tmp_path, "llama")
    done = _convert(src, tmp_path / "out", "universal", "md5")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "INTEROP_DIGEST='md5'" in lines[0] and "xxh128" in lines[0], done.stderr
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


def _lazy(tensor: torch.Tensor, digest: str | None) -> LazyTensor:
    return LazyTensor(TensorSpec(tuple(tensor.shape), dtype_name=str(tensor.dtype).removeprefix("torch.")), lambda: tensor, "t", digest)


def test_diff_compares_bytes_not_the_recorded_digests():
    """Two tensors whose manifests record the same digest but whose bytes differ (a copy vouching for itself) are
    reported as differing; a NaN equals itself, -0.0 is not 0.0 (bit for bit)."""
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([1.0, 2.5, 3.0])
    same = "xxh128:" + "0" * 32
    a_t, b_t = _lazy(a, same), _lazy(b, same)
    a_t.check_digest = b_t.check_digest = lambda computed: None  # the recorded digests are taken as they are
    assert _compare("w", a_t, b_t, 0.0).status == "differs"
    nan = torch.tensor([float("nan"), 1.0])
    assert _compare("n", _lazy(nan, None), _lazy(nan.clone(), None), 0.0).status == "exact"
    assert _compare("z", _lazy(torch.tensor([0.0]), None), _lazy(torch.tensor([-0.0]), None), 0.0).status == "differs"
    bf = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert _compare("t", _lazy(bf.t(), None), _lazy(bf.t().contiguous(), None), 0.0).status == "exact"


def test_an_earlier_versions_tensor_is_checked_from_its_file_by_its_own_algorithm_before_it_is_sliced(tmp_path):
    """A tensor whose manifest records a BLAKE3 digest (a checkpoint of an earlier version) is checked once, hashed
    by that algorithm from its file, before its slices are handed out: not loaded whole for every slice, as it was
    while only this version's algorithm was hashed so (a ZeRO target cuts every tensor into each rank's slices).
    Bytes that differ from the record are still refused."""
    import dataclasses

    import pytest
    from safetensors.torch import save_file

    from interop.errors import CorruptCheckpointError
    from interop.safetensors_io import SafetensorsFile
    from interop.tensors import raw_bytes

    w = torch.randn(64, 32)
    save_file({"w": w}, tmp_path / "w.safetensors")
    stored = SafetensorsFile(str(tmp_path / "w.safetensors"))

    def whole():
        raise AssertionError("loaded whole to be checked")

    def recorded(value):
        return dataclasses.replace(stored.lazy("w"), loader=whole, digest=digests.of_bytes(raw_bytes(value), "blake3"))

    lazy = recorded(w)
    for lo, hi in ((0, 100), (100, 2048)):
        assert torch.equal(lazy.flat_slice(lo, hi).load(), w.reshape(-1)[lo:hi])
    with pytest.raises(CorruptCheckpointError, match="tensor bytes differ from the digest its manifest records"):
        recorded(w + 1).flat_slice(0, 100).load()
