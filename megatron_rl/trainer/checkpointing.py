"""Step checkpoints on disk: `<dir>/global_step_<k>/{actor,critic,trainer_state.json,manifest.json}`.

A step is written into `global_step_<k>.tmp`; when every role has saved, `manifest.json` (every file of the
checkpoint with its size and sha256; tensor shards hashed only with trainer.checkpoint_hash_shards) is written LAST and the directory renamed, so a
crash mid-save leaves the previous checkpoint intact and a checkpoint without a matching manifest is never
trusted. On load the manifest is checked against the files; auto-resume takes the newest checkpoint that passes
and says which newer ones it skipped and why. `latest_checkpointed_iteration.txt` (verl's name) points at the
newest one.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from megatron_rl.config.worker_rules import check_resume_setting
from megatron_rl.trainer.file_hashes import sha256_of_files

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "manifest.json"
SHARD_SUFFIX = ".distcp"  # tensor shards: hashed with trainer.checkpoint_hash_shards, else size-checked
TRAINER_STATE_FILE = "trainer_state.json"
HF_FINAL_DIR = "hf_final"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
# Half-written directories a crash can leave: a step being saved, the final export being written.
LEFTOVER = re.compile(r"^(global_step_\d+|hf_final)\.(tmp|old)$")


def _no_barrier() -> None:
    return None


def _io_error(err: OSError, what: str, path: Path) -> OSError:
    """The same OSError (errno kept), its message naming what was being written and where."""
    detail = err.strerror or str(err)
    where = f" ({err.filename})" if err.filename and str(err.filename) != str(path) else ""
    return type(err)(err.errno, f"{what} {path} failed: {detail}{where}") if err.errno else OSError(
        f"{what} {path} failed: {err}")


def write_manifest(directory: Path, step: int, hash_shards: bool = False) -> None:
    files = {str(p.relative_to(directory)): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}
    # sha256 of what the driver reads back (trainer state, the rollouts of an async run) and the checkpoint's
    # metadata (issue 33); of the tensor shards, the bulk, only when asked (issue 56; the cost: docs/trainer.md)
    hashed = [name for name in files if hash_shards or not name.endswith(SHARD_SUFFIX)]
    hashes = sha256_of_files(directory, hashed)
    tmp = directory / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps({"global_step": step, "files": files, "sha256": hashes}, indent=1))
    os.replace(tmp, directory / MANIFEST_FILE)


def check_resume_from_path(explicit: str) -> bool:
    """trainer.resume_from_path is a checkpoint the loop can resume: the rule the loop's resume and preflight
    (trainer/run_identity.py check_resume) both run. FileNotFoundError naming the key when it is not a directory
    or an incomplete save; True when it is resumed unverified (a save from before manifests: no manifest, but its
    trainer state)."""
    path = Path(explicit)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise FileNotFoundError(f"trainer.resume_from_path={explicit} {what} (trainer.resume_mode=resume_path "
                                "resumes a global_step_N directory of a run)")
    problem = checkpoint_problem(path)
    if problem is not None and not (path / MANIFEST_FILE).exists() and (path / TRAINER_STATE_FILE).is_file():
        return True
    if problem is not None:
        raise FileNotFoundError(f"trainer.resume_from_path={explicit} is incomplete: {problem}")
    return False


def checkpoint_problem(directory: Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint, or None when its manifest matches its files."""
    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():
        if (directory / TRAINER_STATE_FILE).is_file():
            return (f"no {MANIFEST_FILE}: the save never finished (one written before manifests existed can be "
                    f"resumed with trainer.resume_mode=resume_path trainer.resume_from_path={directory})")
        return f"no {MANIFEST_FILE} and no {TRAINER_STATE_FILE}: the save never finished"
    try:
        recorded = json.loads(manifest.read_text())
        files, hashes = recorded["files"], recorded.get("sha256", {})  # manifests before issue 33: sizes only
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest} cannot be read ({err})"
    if TRAINER_STATE_FILE not in files:
        return f"its manifest lists no {TRAINER_STATE_FILE}"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
    # every file the manifest hashes (manifests before issue 56 hold no shard hashes: those stay size-checked)
    for name, digest in sha256_of_files(directory, [name for name in files if name in hashes]).items():
        if digest != hashes[name]:
            return f"{name} does not match the sha256 in its manifest: it changed after the save"
    return None


class TrainerCheckpointer:
    """Under Ray one driver process writes. Under torchrun every rank runs the trainer and the workers
    save collectively into the same directory, so only the ``is_writer`` rank touches the directory
    layout, and ``barrier`` keeps the ranks in step around it. ``hash_shards``: trainer.checkpoint_hash_shards."""

    def __init__(self, root: Path, keep_last: int, is_writer: bool = True,
                 barrier: Callable[[], None] = _no_barrier, hash_shards: bool = False) -> None:
        if keep_last < 1:
            raise ValueError(f"trainer.max_ckpt_to_keep must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.is_writer = is_writer
        self.barrier = barrier
        self.hash_shards = hash_shards

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    @contextmanager
    def saving(self, step: int) -> Iterator[Path]:
        """Yield a temporary directory to fill; on success it gets its manifest and becomes `global_step_<step>`."""
        final, tmp = self.step_dir(step), self.root / f"global_step_{step}.tmp"
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as err:
                raise _io_error(err, f"saving the step-{step} checkpoint into", tmp) from err
        self.barrier()
        try:
            yield tmp
        except OSError as err:
            raise _io_error(err, f"saving the step-{step} checkpoint into", tmp) from err
        except (KeyboardInterrupt, SystemExit):
            # A forced exit (a second SIGTERM / ctrl-C) mid-save: leave no half-written step behind (issue 56).
            if self.is_writer:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.barrier()
        if self.is_writer:
            try:
                write_manifest(tmp, step, self.hash_shards)  # last: a checkpoint without it is incomplete
                if final.exists():
                    shutil.rmtree(final)
                tmp.rename(final)
                latest = self.root / (LATEST_FILE + ".tmp")
                latest.write_text(str(step))
                os.replace(latest, self.root / LATEST_FILE)
            except OSError as err:
                raise _io_error(err, f"saving the step-{step} checkpoint into", tmp) from err
            self._prune()
        self.barrier()

    @contextmanager
    def publishing(self, final: Path) -> Iterator[Path]:
        """Yield a temporary directory to fill; on success it replaces ``final`` in one rename, so ``final`` is
        always either the previous whole export or the new whole one (the final HF export)."""
        tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as err:
                raise _io_error(err, "writing", final) from err
        self.barrier()
        try:
            yield tmp
        except OSError as err:
            raise _io_error(err, "writing", final) from err
        self.barrier()
        if self.is_writer:
            try:
                if final.exists():
                    shutil.rmtree(old, ignore_errors=True)
                    final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            except OSError as err:
                raise _io_error(err, "writing", final) from err
        self.barrier()

    def write_trainer_state(self, directory: Path, state: dict[str, Any]) -> None:
        if self.is_writer:
            (directory / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=1))

    def read_trainer_state(self, directory: Path) -> dict[str, Any]:
        path = directory / TRAINER_STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {directory} has no {TRAINER_STATE_FILE}: incomplete or not ours")
        try:
            return json.loads(path.read_text())
        except ValueError as err:
            raise ValueError(f"checkpoint state {path} is not valid JSON: {err}") from err

    def completed_steps(self) -> list[int]:
        """Steps that have a `global_step_<k>` directory (complete or not; see ``intact_steps``)."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())

    def newest_intact(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest complete checkpoint (or None) and the newer ones skipped, each with the reason."""
        skipped: list[tuple[Path, str]] = []
        for step in reversed(self.completed_steps()):
            path = self.step_dir(step)
            problem = checkpoint_problem(path)
            if problem is None:
                return path, skipped
            skipped.append((path, problem))
        return None, skipped

    def resume_path(self, mode: str, explicit: str | None) -> Path | None:
        """trainer.resume_mode: auto (newest intact here, if any) | disable | resume_path (trainer.resume_from_path)."""
        check_resume_setting(mode, explicit)
        if mode == "disable":
            return None
        if mode == "resume_path":
            if check_resume_from_path(str(explicit)):
                logger.warning("trainer.resume_from_path=%s has no %s (written before manifests?): resuming from it "
                               "unverified", explicit, MANIFEST_FILE)
            return Path(str(explicit))
        path, skipped = self.newest_intact()
        for bad, why in skipped:
            logger.warning("auto-resume: skipping %s: %s", bad, why)
        if skipped:
            logger.warning("auto-resume: %s", f"falling back to {path}" if path else
                           "no intact checkpoint left; starting from step 0")
        return path

    def clean_leftovers(self) -> list[Path]:
        """Remove the `.tmp` / `.old` directories a crashed save or export left (writer only); returns them."""
        if not (self.is_writer and self.root.is_dir()):
            return []
        removed = []
        for path in sorted(self.root.iterdir()):
            if not (LEFTOVER.match(path.name) and path.is_dir()):
                continue
            whole = path.with_suffix("")
            if path.suffix == ".old" and not whole.exists():
                # The export was interrupted between its two renames: the previous whole one comes back.
                logger.warning("restoring %s from %s, left by an interrupted export", whole, path)
                path.rename(whole)
                continue
            removed.append(path)
        for path in removed:
            logger.warning("removing %s, left by an interrupted save", path)
            shutil.rmtree(path, ignore_errors=True)
        return removed

    def _prune(self) -> None:
        for step in self.completed_steps()[: -self.keep_last]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
