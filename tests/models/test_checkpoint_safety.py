"""A checkpoint's ``.metadata`` is unpickled by torch with plain ``pickle.load``; a planted one must be
refused, naming the file and the global, before anything runs (issue 33)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from megatron_rl.models.checkpoint_safety import UnsafeCheckpointError, check_checkpoint_metadata


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


def _dcp_checkpoint(path: Path, obj) -> None:
    """A real torch_dist checkpoint as megatron-core writes one: tensors, and an object stored as bytes."""
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"weight": torch.arange(6.0).view(2, 3), "rng_state": obj,
              "numpy": {"state": np.random.get_state()}}, checkpoint_id=str(path), no_dist=True)


def test_a_real_checkpoint_passes(tmp_path):
    import random

    _dcp_checkpoint(tmp_path / "actor", {"python": random.getstate(), "torch": __import__("torch").get_rng_state()})
    check_checkpoint_metadata(tmp_path / "actor")


def test_a_planted_stored_object_runs_code_in_torch_but_is_refused_here(tmp_path):
    """The objects a checkpoint stores (RNG states, _extra_state) are read by torch with weights_only=False."""
    import torch.distributed.checkpoint as dcp

    checkpoint, marker = tmp_path / "actor", tmp_path / "marker"
    _dcp_checkpoint(checkpoint, _RunsCode(marker))
    state = {"weight": __import__("torch").zeros(2, 3), "rng_state": None, "numpy": {"state": None}}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)  # the hole: loading it runs the command
    assert marker.exists()
    marker.unlink()

    with pytest.raises(UnsafeCheckpointError, match=r"__0_0\.distcp: the stored object 'rng_state' asks for "
                                                    r"\['(posix|os)\.system'\]"):
        check_checkpoint_metadata(checkpoint)
    assert not marker.exists()


def test_a_truncated_metadata_is_named(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x04\x95")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: not a readable checkpoint metadata"):
        check_checkpoint_metadata(tmp_path)
