"""docs/configuration.md's table of every verl key and its fate is generated from the code the compat entry runs
(megatron_rl/compat/verl/key_table.py over keys.py and defaults.py); these check that the page is current and that
the table covers every key of verl's config."""
from __future__ import annotations

import functools

from megatron_rl.compat.verl import key_table
from megatron_rl.compat.verl.keys import Fate, fate_of, rule_for


@functools.lru_cache(maxsize=1)
def _rows() -> list[key_table.Row]:
    return key_table.table_rows()


def test_the_docs_section_is_what_the_code_renders():
    documented = key_table.current_section(key_table.DOC.read_text())
    assert documented == key_table.render(), (
        f"the verl key table in {key_table.DOC} is stale: run `{key_table.WRITE_COMMAND}`")


def test_every_key_of_verls_config_has_a_fate_and_exactly_one_row():
    keys = key_table.verl_leaf_keys()
    assert len(keys) == len(set(keys)) > 500
    assert not [key for key in keys if key.rpartition(".")[2] == "_target_"]
    for key in keys:
        assert isinstance(fate_of(key)[0], Fate), key
    covered = [key for row in _rows() for key in row.keys]
    assert covered == keys  # in verl's order, each once
    for row in _rows():
        assert {fate_of(key) for key in row.keys} == {(row.fate, fate_of(row.keys[0])[1])}, row.label
        if row.fate is Fate.same or (row.fate is Fate.mapped and "*" not in rule_for(row.keys[0]).pattern):
            assert len(row.keys) == 1, row.label  # (keys a rule maps by pattern are grouped like the others)


def test_free_form_dicts_are_one_row_and_not_descended():
    keys = set(key_table.verl_leaf_keys())
    assert "actor_rollout_ref.actor.megatron.override_transformer_config" in keys
    assert "actor_rollout_ref.rollout.engine_kwargs" in keys
    assert not [key for key in keys if ".override_transformer_config." in key or ".engine_kwargs." in key
                or ".override_config." in key]


def test_what_is_refused_or_held_at_verls_default_says_why():
    rows = [(row.label, row.fate, row.why) for row in _rows()]
    rows += [(key, *fate_of(key.lstrip("+~"))) for key, _ in key_table.script_keys()]
    assert not [label for label, fate, why in rows if fate in (Fate.default, Fate.refused) and not why.strip()]
    assert not [label for label, fate, why in rows if fate is Fate.mapped and not why.strip()]


def test_the_script_keys_verls_config_lacks_are_listed():
    listed = dict(key_table.script_keys())
    assert "model_engine" in listed
    assert "+reward_model.reward_kwargs.overlong_buffer_cfg.len" in listed
    assert "actor_rollout_ref.rollout.name" not in listed  # verl's config has it ('???': no default)


def test_fate_counts():
    counts = key_table.fate_counts()
    print({fate.value: counts.get(fate, 0) for fate in Fate})
    assert sum(counts.values()) == len(key_table.verl_leaf_keys())
    assert counts[Fate.same] >= 150, counts
    assert counts[Fate.mapped] >= 20, counts
    assert counts[Fate.dropped] >= 5, counts
    assert counts[Fate.default] >= 300, counts
