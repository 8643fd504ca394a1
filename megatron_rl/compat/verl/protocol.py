"""``verl.protocol`` on megatron_rl.protocol: the DataProto class and its module-level helpers."""

from megatron_rl.protocol import *  # noqa: F403
from megatron_rl.protocol import DataProto  # noqa: F401
from megatron_rl.protocol import __all__ as _all

__all__ = list(_all)
