"""verl's module layout on megatron-rl's implementations (docs/algorithms.md, "Coming from verl").

    from megatron_rl.compat.verl import DataProto                   # verl: from verl import DataProto
    from megatron_rl.compat.verl.protocol import DataProto, union_tensor_dict
    from megatron_rl.compat.verl.trainer.ppo import core_algos      # register_adv_est, agg_loss, ...
    from megatron_rl.compat.verl.utils.reward_score import default_compute_score
"""

from megatron_rl.compat.verl.protocol import DataProto

__all__ = ["DataProto"]
