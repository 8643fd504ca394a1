"""A checkpoint write on a full disk names the device, the path and "No space left on device" (issue 33 item 12);
before, torch's writer said "[enforce fail at inline_container.cc] unexpected pos 576 vs 534"."""
from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

from megatron_rl.workers import disk_space
from megatron_rl.workers.disk_space import checked_save


def _torch_save(state, directory):
    os.makedirs(directory, exist_ok=True)
    torch.save(state, os.path.join(directory, "shard.pt"))


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs: a real full disk (needs root and mount; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield mount
    finally:
        import gc

        gc.collect()  # torch's failed writer may still hold the file open: the mount would be busy
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_during_the_write_is_named(tiny_disk):
    target = tiny_disk / "global_step_1.tmp" / "actor.tmp"
    state = {"extra": {"blob": b"x" * 200_000}}  # no tensors: the check before the write cannot see it coming
    with pytest.raises(RuntimeError, match="unexpected pos"):  # what torch says on its own
        _torch_save(state, target)
    with pytest.raises(OSError) as err:
        checked_save(_torch_save, state, target)
    assert err.value.errno == errno.ENOSPC
    message = str(err.value)
    assert "No space left on device" in message and str(target) in message and f"mounted at {tiny_disk}" in message
    assert "unexpected pos" in str(err.value.__cause__)


def test_free_space_is_checked_before_the_write(tiny_disk):
    target = tiny_disk / "actor.tmp"
    calls = []
    with pytest.raises(OSError, match=r"No space left on device: writing the checkpoint .* about 1.00 MiB to write on this rank, 0.06 MiB free"):
        checked_save(lambda s, d: calls.append(d), {"w": torch.zeros(1 << 18)}, target)  # 1 MiB > 64 KiB
    assert calls == []  # nothing half-written


def test_other_errors_pass_through(tmp_path, monkeypatch):
    def broken(state, directory):
        raise ValueError("not a disk problem")

    with pytest.raises(ValueError, match="not a disk problem"):
        checked_save(broken, {"w": torch.zeros(4)}, tmp_path / "ckpt")
    monkeypatch.setattr(disk_space, "_free_bytes", lambda path: 0)

    def torch_says(state, directory):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    with pytest.raises(OSError, match="No space left on device"):
        checked_save(torch_says, {"w": torch.zeros(4)}, tmp_path / "ckpt")
