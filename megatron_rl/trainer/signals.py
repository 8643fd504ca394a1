"""Turn SIGTERM / SIGUSR1 (SLURM's warning before the time limit) into "checkpoint, then exit cleanly"."""
from __future__ import annotations

import logging
import signal
from types import FrameType

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# Exit codes of `python -m megatron_rl.train` (docs/trainer.md): 0 only for a finished run.
EXIT_FINISHED = 0
EXIT_FAILED = 1  # an error; the traceback is in the output and in <run dir>/train.log
EXIT_CONFIG_ERROR = 2  # rejected before anything started; nothing was written
EXIT_STOPPED_RESUMABLE = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGUSR1; re-run the same command to resume


class StopRequest:
    """Set by a signal handler; the trainer checks it at the end of every step."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.heeded = False  # a step's end saw the request: that step's checkpoint is the stop's, the loop ends

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        self.reason = reason

    def heed(self) -> bool:
        """Read once at a step's end, by the save and the loop's end alike: a signal that lands after it (while
        the step is saved or logged) is heeded at the next step's end, never by a loop ending unsaved."""
        self.heeded = self.requested
        return self.heeded

    def install(self) -> "StopRequest":
        """(Re-)install the handlers; call again after a library (Ray) replaced them with its own."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        logger.warning("received %s: will save a checkpoint and stop after the current step", name)
        self.request(name)


def keep_handlers_through_ray() -> None:
    """`ray.init` replaces the driver's SIGTERM handler with `sys.exit`, which, arriving while Ray and the
    workers start, ends in a native abort (rc 134) instead of a clean stop. Keep ours: a SIGTERM then stops
    the run at the next check (before the first step, or after the current one)."""
    try:
        import ray._private.utils as ray_utils
    except ImportError:
        return
    ray_utils.set_sigterm_handler = lambda _handler: None
