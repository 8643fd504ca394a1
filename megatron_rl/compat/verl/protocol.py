"""``verl.protocol`` on megatron_rl.protocol: the DataProto class and its module-level helpers."""

from megatron_rl.protocol import *  # noqa: F401,F403
from megatron_rl.protocol import __all__ as _all
from megatron_rl.protocol import DataProto, collate_dicts

collate_fn = collate_dicts

__all__ = [*_all, "collate_fn"]
