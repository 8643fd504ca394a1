"""verl's SFT keys on megatron-rl (compat/verl/sft_keys.py): docs/sft.md's table is what the code renders, every key of
verl's SFT config (pinned: verl_sft_trainer_megatron.yaml) has a fate and one row, and the rules the SFT trainer's own
keys need (the warm-up ratio, the schedule's style, after_each_epoch, torchrun's world) do what verl does."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.compat.verl import sft_key_table
from megatron_rl.compat.verl.keys import Fate
from megatron_rl.compat.verl.sft_keys import analogue, fate_of_sft, sft_leaf_keys, translate_sft_key
from megatron_rl.compat.verl.trainer.sft_trainer import translate
from megatron_rl.config import ConfigError


def test_the_docs_section_is_what_the_code_renders():
    documented = sft_key_table.current_section(sft_key_table.DOC.read_text())
    assert documented == sft_key_table.render(), (
        f"the verl SFT key table in {sft_key_table.DOC} is stale: run `{sft_key_table.WRITE_COMMAND}`")


def test_every_key_of_verls_sft_config_has_a_fate_and_exactly_one_row():
    keys = list(sft_leaf_keys())
    assert len(keys) == len(set(keys)) > 150
    assert {"model.path", "engine.tensor_model_parallel_size", "optim.lr", "data.micro_batch_size_per_gpu",
            "trainer.n_gpus_per_node", "checkpoint.save_contents", "engine.override_transformer_config"} <= set(keys)
    for key in keys:
        assert isinstance(fate_of_sft(key)[0], Fate), key
    assert [key for row in sft_key_table.table_rows() for key in row.keys] == keys
    rows = [(row.label, row.fate, row.why) for row in sft_key_table.table_rows()]
    assert not [label for label, fate, why in rows if fate is not Fate.same and not why.strip()]


@pytest.mark.parametrize(("key", "ours"), [
    ("model.path", "actor_rollout_ref.model.path"),
    ("engine.tensor_model_parallel_size", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"),
    ("optim.lr", "actor_rollout_ref.actor.optim.lr"),
    ("data.micro_batch_size_per_gpu", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("data.max_token_len_per_gpu", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("data.use_dynamic_bsz", "actor_rollout_ref.actor.use_dynamic_bsz"),
    ("data.messages_key", "data.messages_key"),
])
def test_keys_are_rewritten_onto_the_actors(key, ours):
    assert analogue(key) == ours
    out, _ = translate_sft_key(key, "2", {key: "2"}, {ours: "2"})
    assert out == [f"{'++' if ours != key else ''}{ours}=2"]


def rows(tmp_path, n: int) -> str:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "q"},
                                                       {"role": "assistant", "content": "a"}]}] * n), path)
    return str(path)


def test_the_warmup_ratio_is_a_number_of_steps_as_verls_scheduler_counts_them(tmp_path):
    """verl: int(ratio x total steps) where optim.lr_warmup_steps <= 0; total = trainer.total_training_steps, else
    (rows // train_batch_size) x total_epochs (its loader drops the last partial batch)."""
    seen = {"data.train_files": rows(tmp_path, 103), "data.train_batch_size": "10", "trainer.total_epochs": "3"}
    assert translate_sft_key("optim.lr_warmup_steps_ratio", "0.1", seen, {})[0] == [
        "actor_rollout_ref.actor.optim.lr_warmup_steps=3"]  # int(0.1 x 10 x 3)
    assert translate_sft_key("optim.lr_warmup_steps_ratio", "0.1", seen | {"trainer.total_training_steps": "55"},
                             {})[0] == ["actor_rollout_ref.actor.optim.lr_warmup_steps=5"]
    assert translate_sft_key("optim.lr_warmup_steps_ratio", "0.1", seen | {"optim.lr_warmup_steps": "7"}, {})[0] == []
    assert translate_sft_key("optim.lr_warmup_steps", "7", seen, {})[0] == [
        "actor_rollout_ref.actor.optim.lr_warmup_steps=7"]
    with pytest.raises(ConfigError, match=r"optim.lr_warmup_steps_ratio=1.5: a ratio of the run's steps"):
        translate_sft_key("optim.lr_warmup_steps_ratio", "1.5", seen, {})


def test_after_each_epoch_and_the_decay_style(tmp_path):
    seen = {"data.train_files": rows(tmp_path, 50), "data.train_batch_size": "8"}
    assert translate_sft_key("trainer.test_freq", "after_each_epoch", seen, {})[0] == ["trainer.test_freq=6"]
    assert translate_sft_key("optim.lr_decay_style", "cosine", seen, {})[0] == [
        "actor_rollout_ref.actor.optim.lr_scheduler=cosine"]
    with pytest.raises(ConfigError, match="optim.lr_decay_style=linear"):
        translate_sft_key("optim.lr_decay_style", "linear", seen, {})


def test_verl_keys_are_refused_under_their_own_names(tmp_path):
    """A refusal the RL table gives an actor key names verl's SFT key, not the actor's."""
    with pytest.raises(ConfigError, match=r"^engine.grad_offload=True: .*param_offload"):
        translate([f"model.path={tmp_path}", "engine.grad_offload=True"], env={})
    with pytest.raises(ConfigError, match=r"^optim.min_lr=1: min_lr=1 must lie in \[0, "):
        translate([f"model.path={tmp_path}", "optim.lr=1e-5", "optim.min_lr=1"], env={})
    with pytest.raises(ConfigError, match=r"^engine.dtype=float16: .*only verl's default \('bfloat16'\)"):
        translate([f"model.path={tmp_path}", "engine.dtype=float16"], env={})
    with pytest.raises(ConfigError, match=r"^trainer.max_ckpt_to_keep=null: verl keeps every checkpoint"):
        translate([f"model.path={tmp_path}", "trainer.max_ckpt_to_keep=null"], env={})
