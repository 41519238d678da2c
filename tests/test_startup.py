"""A conversion's start-up: the source's digests are computed beside the import of torch (which takes a core
for a second), never trusted early: a file changed after its early digest is hashed again, and a corrupted
source is refused exactly as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from interop import digests
from tests.architectures import ROOT, saved


def test_an_early_digest_is_used_only_for_the_file_it_was_taken_of(tmp_path):
    same, changed, gone = (tmp_path / n for n in ("same.bin", "changed.bin", "gone.bin"))
    for p in (same, changed, gone):
        p.write_bytes(os.urandom(1 << 20))
    digests.hash_ahead([(str(p), "blake3") for p in (same, changed, gone)], threads=1)
    for p in (same, changed, gone):
        digests._AHEAD[str(p)][2].result(timeout=60)
    expected_same = digests._of_file(str(same), "blake3")
    changed.write_bytes(b"x" * (1 << 20))  # same size: the change is seen by its times
    os.utime(changed, ns=(1, 1))
    gone.unlink()
    gone.write_bytes(b"y")  # another file at the same path
    assert digests.of_file(str(same)) == expected_same
    assert digests.of_file(str(changed)) == digests.of_bytes(b"x" * (1 << 20))
    assert digests.of_file(str(gone)) == digests.of_bytes(b"y")
    assert not digests._AHEAD  # each taken once


def test_the_source_is_digested_before_torch_is_imported_and_a_flip_is_still_refused(tmp_path):
    _, src = saved(tmp_path, "llama")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    uni = tmp_path / "uni"
    subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(src), str(uni), "--to", "universal"],
                   env=env, check=True, capture_output=True, timeout=300)
    probe = ("import sys, json; from converters.console import check_ahead; check_ahead(sys.argv[1:]); "
             "from interop import digests; print(json.dumps([sorted(digests._AHEAD), 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe, "convert", str(uni), str(tmp_path / "out"), "--to", "hf"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    started, torch_imported = json.loads(done.stdout.strip().splitlines()[-1])
    manifest = json.loads((uni / "manifest.json").read_text())
    plain = sorted(str(uni / rel) for rel, rec in manifest["files"].items() if ":" in rec["digest"]
                   and not rec["digest"].split(":")[0].endswith("-st"))
    assert started == plain and plain and not torch_imported
    config = uni / "model" / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"vocab_size": 131', '"vocab_size": 132'))  # one byte, still a valid config
    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(uni), str(tmp_path / "out"), "--to", "hf"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (f"interop convert: error: {config}: content digest differs from the manifest "
                                                    "(the file was altered or corrupted)")
    assert not (tmp_path / "out").exists()
