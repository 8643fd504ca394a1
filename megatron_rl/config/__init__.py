"""Configuration: the structured schema and loading through Hydra. Validation against the domain packages
(estimators, reward models, layouts) lives above them, in ``megatron_rl.plan.validate``."""
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.loader import CONFIG_DIR, load_config, typed_config
from megatron_rl.config.schema import PPOTrainerConfig, register_configs

__all__ = ["CONFIG_DIR", "ConfigError", "PPOTrainerConfig", "load_config", "register_configs", "typed_config"]
