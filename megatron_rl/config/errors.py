"""The error every configuration check raises (schema, loading, validation, preflight)."""


class ConfigError(ValueError):
    """A setting that cannot work; the message names the key(s) and the values seen."""
