"""Configuration: the structured schema, loading through Hydra, and validation."""
from megatron_rl.config.loader import CONFIG_DIR, load_config
from megatron_rl.config.schema import PPOTrainerConfig, register_configs
from megatron_rl.config.validate import ConfigError, DerivedSizes, RoleSizes, validate

__all__ = ["CONFIG_DIR", "ConfigError", "DerivedSizes", "PPOTrainerConfig", "RoleSizes", "load_config",
           "register_configs", "validate"]
