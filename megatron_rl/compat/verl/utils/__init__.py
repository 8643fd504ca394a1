"""verl.utils on megatron-rl: reward_score, and the helpers verl's tests and trainer code import
(tensordict_utils.get_tensordict, metric, py_functional.append_to_dict)."""
