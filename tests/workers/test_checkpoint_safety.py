"""A checkpoint's ``.metadata`` is unpickled by torch with plain ``pickle.load``; a planted one must be
refused, naming the file and the global, before anything runs (issue 33)."""

from __future__ import annotations

import glob
import os
import pickle
import shutil
from pathlib import Path

import pytest

from megatron_rl.workers.checkpoint_safety import UnsafeCheckpointError, check_checkpoint_metadata

FIXTURE_GLOB = "/tmp/pytest-of-*/*/*/global_step_*/actor/.metadata"


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(checkpoint: Path, marker: Path) -> None:
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))


def test_planted_metadata_runs_code_in_torch_but_is_refused_here(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = tmp_path / "actor"
    checkpoint.mkdir()
    marker = tmp_path / "marker"
    _plant(checkpoint, marker)

    with pytest.raises(AttributeError):  # the hole: torch's reader runs it, then fails on the int it returned
        FileSystemReader(str(checkpoint)).read_metadata()
    assert marker.exists()
    marker.unlink()

    with pytest.raises(UnsafeCheckpointError, match=r"actor/\.metadata: refusing .* posix\.system|actor/\.metadata: refusing .* os\.system"):
        check_checkpoint_metadata(checkpoint)
    assert not marker.exists()


def test_load_checkpoint_refuses_before_megatron_reads(tmp_path, monkeypatch):
    from megatron_rl.workers import checkpoint as ckpt

    checkpoint = tmp_path / "actor"
    checkpoint.mkdir()
    marker = tmp_path / "marker"
    _plant(checkpoint, marker)
    read = []
    monkeypatch.setattr(ckpt, "read_checkpoint_metadata", lambda path: {
        "value_head": False, "has_optimizer": False, "layout": {}, "role": "actor"})
    monkeypatch.setattr(ckpt, "_layout", lambda: {"tp": 1})
    monkeypatch.setattr(ckpt, "_sharded_state", lambda *a, **k: {})
    monkeypatch.setattr(ckpt.dist_checkpointing, "load", lambda state, path: read.append(path))

    class Engine:
        name, value_head, trainable, model = "actor", False, False, []

    with pytest.raises(UnsafeCheckpointError, match=r"actor/\.metadata"):
        ckpt.load_checkpoint(Engine(), checkpoint)
    assert not read and not marker.exists()


def test_real_metadata_passes(tmp_path):
    real = sorted(glob.glob(FIXTURE_GLOB))
    if not real:
        pytest.skip("no saved checkpoint under /tmp/pytest-of-*; test_workers_roles -k checkpoint covers real loads")
    for path in real[:5]:
        copy = tmp_path / str(abs(hash(path)))
        copy.mkdir()
        shutil.copy(path, copy / ".metadata")
        check_checkpoint_metadata(copy)


def test_a_truncated_metadata_is_named(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x04\x95")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: not a readable checkpoint metadata"):
        check_checkpoint_metadata(tmp_path)
