"""interop.background: a background commit's digests take few threads, so the training thread keeps the GIL."""

from __future__ import annotations

import threading
import time

from interop import background, digests


def test_a_background_commit_digests_on_few_threads_and_a_foreground_one_on_every_core(tmp_path, monkeypatch):
    path = tmp_path / "shard.bin"
    path.write_bytes(bytes(range(256)) * (8 << 12))  # 8 blocks of 1 MiB
    used: set[int] = set()
    hash_block = digests.hash_block

    def spread(*args, **kwargs):
        used.add(threading.get_ident())
        time.sleep(0.05)  # every pool thread gets a block
        return hash_block(*args, **kwargs)

    monkeypatch.setattr(digests.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(digests, "hash_block", spread)
    foreground = digests.of_files([str(path)], block_bytes=1 << 20)[str(path)]
    assert len(used) > background.BACKGROUND_DIGEST_THREADS
    used.clear()
    commit = background.PendingCommit(lambda: digests.of_files([str(path)], block_bytes=1 << 20)[str(path)], "test")
    assert commit.wait() == foreground  # the same digest, on fewer threads
    assert 1 <= len(used) <= background.BACKGROUND_DIGEST_THREADS
    assert digests.default_threads() == 8  # the limit was the commit thread's alone
