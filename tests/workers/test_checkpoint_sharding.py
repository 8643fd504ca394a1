"""The distributed optimizer's checkpoint layout (issue 32 item 14).

New saves ask megatron-core for ``fully_sharded_model_space`` (each rank writes its own shard of the
Adam state, no gather) instead of ``fully_reshardable`` (which all-gathers the whole DP optimizer state
into every rank's host RAM at save), record it in ``megatron_rl_checkpoint.json``, and a load asks for
the recorded type, so checkpoints saved before (no type recorded) still load as ``fully_reshardable``.
The distributed optimizer cannot be built on CPU here (``capabilities.distributed_optimizer_blocker``),
so the engine is a stand-in that records what ``sharded_state_dict`` was asked for.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_rl.workers import checkpoint as ckpt

LAYOUT = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}


class RecordingOptimizer:
    def __init__(self):
        self.calls = []

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
        self.calls.append((is_loading, dict(metadata or {})))
        return {"param_state": "stand-in"}

    def load_state_dict(self, state):
        pass


class Scheduler:
    def state_dict(self):
        return {"step": 3}

    def load_state_dict(self, state):
        pass


@pytest.fixture
def engine(monkeypatch):
    saved = {}
    monkeypatch.setattr(ckpt, "_layout", lambda: dict(LAYOUT))
    monkeypatch.setattr(ckpt, "_on_rank_zero", lambda fn, *args: fn(*args))
    monkeypatch.setattr(ckpt, "_rng_sharded_object", lambda: "rng")
    monkeypatch.setattr(ckpt, "_set_rng_state", lambda state: None)
    monkeypatch.setattr(ckpt, "checked_save", lambda save, state, path: saved.update(state))
    monkeypatch.setattr(
        ckpt.dist_checkpointing, "load", lambda state, path: {**saved, "extra": saved.get("extra", {})}
    )
    return SimpleNamespace(
        name="actor", model=[], trainable=True, value_head=False, params_dtype="torch.float32",
        optimizer=RecordingOptimizer(), scheduler=Scheduler(),
    )


def test_save_asks_for_fully_sharded_model_space_and_records_it(engine, tmp_path):
    ckpt.save_checkpoint(engine, tmp_path / "ckpt", extra={"step": 1})
    assert engine.optimizer.calls == [(False, {"distrib_optim_sharding_type": "fully_sharded_model_space"})]
    assert ckpt.read_checkpoint_metadata(tmp_path / "ckpt")["optimizer_sharding_type"] == "fully_sharded_model_space"

    engine.optimizer.calls.clear()
    assert ckpt.load_checkpoint(engine, tmp_path / "ckpt") == {"step": 1}
    assert engine.optimizer.calls == [(True, {"distrib_optim_sharding_type": "fully_sharded_model_space"})]


def test_a_checkpoint_without_a_recorded_type_loads_as_fully_reshardable(engine, tmp_path):
    ckpt.save_checkpoint(engine, tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / ckpt.METADATA_FILE
    metadata = json.loads(meta_path.read_text())
    metadata.pop("optimizer_sharding_type")  # as written before the field existed
    meta_path.write_text(json.dumps(metadata))

    engine.optimizer.calls.clear()
    ckpt.load_checkpoint(engine, tmp_path / "ckpt")
    assert engine.optimizer.calls == [(True, {"distrib_optim_sharding_type": "fully_reshardable"})]


def test_a_recorded_type_is_the_one_loaded(engine, tmp_path):
    ckpt.save_checkpoint(engine, tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / ckpt.METADATA_FILE
    metadata = json.loads(meta_path.read_text())
    metadata["optimizer_sharding_type"] = "dp_reshardable"
    meta_path.write_text(json.dumps(metadata))

    engine.optimizer.calls.clear()
    ckpt.load_checkpoint(engine, tmp_path / "ckpt")
    assert engine.optimizer.calls == [(True, {"distrib_optim_sharding_type": "dp_reshardable"})]


def test_planner_host_ram_at_save():
    from megatron_rl.plan.memory import checkpoint_save_host_bytes

    params = 70_000_000_000 // 32  # a 70B model at TP 8 x PP 4
    old = checkpoint_save_host_bytes(params, "bf16", True, 2, "fully_reshardable")
    new = checkpoint_save_host_bytes(params, "bf16", True, 2, "fully_sharded_model_space")
    assert old == 12 * params and new == old / 2
    assert checkpoint_save_host_bytes(params, "bf16", False, 2, "fully_sharded_model_space") == old
