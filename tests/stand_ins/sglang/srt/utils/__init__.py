"""Stand-in of ``sglang.srt.utils`` (re-exports ``common`` like the real package)."""

from sglang.srt.utils.common import *
from sglang.srt.utils.common import MultiprocessingSerializer, SafeUnpickler  # noqa: F401
