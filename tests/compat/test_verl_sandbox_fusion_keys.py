"""verl's sandbox-fusion settings (issue 54, item 4): the top-level ``sandbox_fusion.*`` and the older
``reward_model.sandbox_fusion.*`` map onto ``reward.sandbox_fusion.*`` (verl's newer layout, ours as it is), where
the code sources' reward reads them (megatron_rl/reward/code_execution.py)."""
from __future__ import annotations

import pytest

from megatron_rl.compat.verl.keys import Fate, fate_of
from megatron_rl.compat.verl.trainer.main_ppo import translate, translate_with_notes
from megatron_rl.config import ConfigError, load_config

URL = "http://10.0.0.5:8080/run_code"


@pytest.mark.parametrize("prefix", ["sandbox_fusion", "reward_model.sandbox_fusion", "reward.sandbox_fusion"])
def test_each_layout_reaches_the_code_rewards_settings(prefix):
    result = translate_with_notes([f"{prefix}.url={URL}", f"{prefix}.max_concurrent=8",
                                   f"{prefix}.memory_limit_mb=512"], with_verl_defaults=False)
    box = load_config(overrides=result.overrides).reward.sandbox_fusion
    assert (box.url, box.max_concurrent, box.memory_limit_mb) == (URL, 8, 512)
    fate = Fate.same if prefix.startswith("reward.") else Fate.mapped
    assert fate_of(f"{prefix}.url")[0] is fate


def test_a_null_limit_keeps_ours_and_an_unknown_leaf_is_refused():
    result = translate_with_notes(["sandbox_fusion.url=null", "sandbox_fusion.max_concurrent=null"],
                                  with_verl_defaults=False)
    box = load_config(overrides=result.overrides).reward.sandbox_fusion
    assert box.url is None and box.max_concurrent == 64
    with pytest.raises((ConfigError, ValueError), match="url, max_concurrent and memory_limit_mb"):
        translate(["reward_model.sandbox_fusion.workers=3"])
