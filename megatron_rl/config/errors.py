"""The error every configuration check raises (schema, loading, validation, preflight)."""


class ConfigError(ValueError):
    """A setting that cannot work; the message names the key(s) and the values seen."""


def require(cond: bool, message: str) -> None:
    """Refuse a setting: ``message`` names the key(s) and the values seen."""
    if not cond:
        raise ConfigError(message)
