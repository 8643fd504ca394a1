"""Turn SIGTERM / SIGINT (ctrl-C) / SIGUSR1 (SLURM's warning before the time limit) into "checkpoint, then exit
cleanly"; a second SIGTERM or SIGINT exits at once, a third without even the clean-up (issue 56)."""
from __future__ import annotations

import logging
import os
import signal
from types import FrameType

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# Signals a person (or a scheduler's kill) repeats to mean "now": SLURM's SIGUSR1 is a warning, never "now".
INSISTING_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# Exit codes of `python -m megatron_rl.train` (docs/trainer.md): 0 only for a finished run.
EXIT_FINISHED = 0
EXIT_FAILED = 1  # an error; the traceback is in the output and in <run dir>/train.log
EXIT_CONFIG_ERROR = 2  # rejected before anything started; nothing was written
EXIT_STOPPED_RESUMABLE = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGINT/SIGUSR1; re-run the same command to resume
EXIT_FORCED = 130  # a second SIGTERM/SIGINT: exited at once, the current step unsaved (re-run resumes from the last)


class StopRequest:
    """Set by a signal handler; the trainer checks it at the end of every step."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.heeded = False  # a step's end saw the request: that step's checkpoint is the stop's, the loop ends
        self.insisted = 0  # SIGTERM/SIGINT received so far
        self._previous: dict[int, object] = {}  # the handlers before the first install, for `restore`

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
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self

    def restore(self) -> None:
        """Put back the handlers found by the first ``install`` (ctrl-C raises KeyboardInterrupt again)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum in INSISTING_SIGNALS:
            self.insisted += 1
        if self.insisted == 2 and signum in INSISTING_SIGNALS:
            # Raised in the main thread, wherever it waits (a hung scorer, a save): the `finally` blocks still
            # stop the servers and Ray this run started; a half-written checkpoint is removed by its writer.
            logger.error("received %s, a second stop signal: exiting now without saving the current step (exit "
                         "code %d); re-run the same command to resume from the newest complete checkpoint", name,
                         EXIT_FORCED)
            raise SystemExit(EXIT_FORCED)
        if self.insisted > 2 and signum in INSISTING_SIGNALS:
            os.write(2, f"received {name} a third time: exiting without clean-up\n".encode())
            os._exit(EXIT_FORCED)  # the clean-up itself hangs: nothing in this process can be trusted to return
        logger.warning("received %s: will save a checkpoint and stop after the current step (send it again to "
                       "exit at once, without saving)", name)
        self.request(self.reason or name)


def keep_handlers_through_ray() -> None:
    """`ray.init` replaces the driver's SIGTERM handler with `sys.exit`, which, arriving while Ray and the
    workers start, ends in a native abort (rc 134) instead of a clean stop. Keep ours: a SIGTERM then stops
    the run at the next check (before the first step, or after the current one)."""
    try:
        import ray._private.utils as ray_utils
    except ImportError:
        return
    ray_utils.set_sigterm_handler = lambda _handler: None
