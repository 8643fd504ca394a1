"""Step checkpoints on disk: `<dir>/global_step_<k>/{actor,critic,trainer_state.json}`.

A step is written into `global_step_<k>.tmp` and renamed when complete, so a crash mid-save leaves the
previous checkpoint intact; `latest_checkpointed_iteration.txt` (verl's name) points at the newest one.
"""
from __future__ import annotations

import json
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

LATEST_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _no_barrier() -> None:
    return None


class TrainerCheckpointer:
    """Under Ray one driver process writes. Under torchrun every rank runs the trainer and the workers
    save collectively into the same directory, so only the ``is_writer`` rank touches the directory
    layout, and ``barrier`` keeps the ranks in step around it."""

    def __init__(self, root: Path, keep_last: int, is_writer: bool = True,
                 barrier: Callable[[], None] = _no_barrier) -> None:
        if keep_last < 1:
            raise ValueError(f"trainer.max_ckpt_to_keep must be >= 1, got {keep_last}")
        self.root = root
        self.keep_last = keep_last
        self.is_writer = is_writer
        self.barrier = barrier

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    @contextmanager
    def saving(self, step: int) -> Iterator[Path]:
        """Yield a temporary directory to fill; on success it becomes `global_step_<step>`."""
        final, tmp = self.step_dir(step), self.root / f"global_step_{step}.tmp"
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        yield tmp
        self.barrier()
        if self.is_writer:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            (self.root / LATEST_FILE).write_text(str(step))
            self._prune()
        self.barrier()

    def write_trainer_state(self, directory: Path, state: dict[str, Any]) -> None:
        if self.is_writer:
            (directory / "trainer_state.json").write_text(json.dumps(state, indent=1))

    def read_trainer_state(self, directory: Path) -> dict[str, Any]:
        path = directory / "trainer_state.json"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {directory} has no trainer_state.json: incomplete or not ours")
        return json.loads(path.read_text())

    def completed_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())

    def resume_path(self, mode: str, explicit: str | None) -> Path | None:
        """trainer.resume_mode: auto (latest here, if any) | disable | resume_path (trainer.resume_from_path)."""
        if mode == "disable":
            return None
        if mode == "resume_path":
            if not explicit:
                raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
            path = Path(explicit)
            if not path.is_dir():
                raise FileNotFoundError(f"trainer.resume_from_path={explicit} is not a directory")
            return path
        if mode != "auto":
            raise ValueError(f"trainer.resume_mode={mode!r} is unknown; known: ['auto', 'disable', 'resume_path']")
        steps = self.completed_steps()
        return self.step_dir(steps[-1]) if steps else None

    def _prune(self) -> None:
        for step in self.completed_steps()[: -self.keep_last]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
