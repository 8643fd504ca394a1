"""constraints/gpu-<engine>.txt: one GPU environment per rollout engine that pip's resolver accepts (issues 14,
49). The engines' torch pins cannot agree (sglang 0.5.23: torch 2.14.1, xgrammar 0.2.7, flashinfer 0.7.2; vllm
0.32.0: torch 2.13.0, xgrammar 0.2.8, flashinfer 0.7.0.post1), so each environment is its engine's pins plus the
trainer's (constraints/gpu-megatron.txt: Megatron-Core, Transformer Engine), both on CUDA 13.0 wheels. The pins
are checked against pyproject.toml offline; the resolver is asked with metadata only (``pip install --dry-run
--report``: no wheel is installed, and PyPI serves wheel metadata without the wheel) and the test skips, saying
so, when the index is unreachable.

A successful resolution is kept outside the clone (``~/.cache/megatron-rl/gpu-resolve/<key>.json``;
``MEGATRON_RL_GPU_RESOLVE_CACHE``: another folder, or ``off``), so clean clones on one machine resolve once: the
key (``resolve_key``) hashes all that decides pip's answer (pip's arguments with each constraints file as its
text and its includes' texts, not its path; pip's and Python's versions and environment markers; the PIP_*
settings pip sees; the listing of any local index or find-links folder they name). A changed input misses and
resolves for real, a failed resolution is never kept, and an entry older than RESOLVE_CACHE_MAX_AGE_S resolves
again (the index can change under the unpinned packages) and is removed when another is kept. The assertions
run on the kept report as on a new one."""
from __future__ import annotations

import email.parser
import hashlib
import importlib.metadata
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("sglang", "vllm")  # the rollout engines with an extra of their own (hf needs nothing more)
TRAINER = ROOT / "constraints" / "gpu-megatron.txt"  # Megatron-Core and Transformer Engine, in every environment
UNREACHABLE = ("Network is unreachable", "Failed to establish a new connection", "Temporary failure in name "
               "resolution", "Could not fetch URL", "No matching distribution found for sglang==",
               "Name or service not known", "Connection refused", "timed out")
PIP_FLAGS = ("install", "--dry-run", "--ignore-installed", "--prefer-binary", "--disable-pip-version-check")
RESOLVE_CACHE_ENV = "MEGATRON_RL_GPU_RESOLVE_CACHE"  # a folder for the kept resolutions, or "off"
RESOLVE_CACHE_MAX_AGE_S = 7 * 24 * 3600  # then resolve again: new releases of unpinned packages can change it


def constraints_file(engine: str) -> Path:
    return ROOT / "constraints" / f"gpu-{engine}.txt"


def pins(path: Path) -> dict[str, str]:
    """Exact pins of a constraints file, with those of the files it includes (``-c other.txt``, as pip reads it:
    relative to the including file)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-c "):
            included = pins(path.parent / line[3:].strip())
            twice = included.keys() & out.keys()
            assert not twice, f"{path}: {sorted(twice)} pinned both here and in {line}"
            out.update(included)
        elif line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path}: {line!r} is not an exact pin"
            assert canonicalize_name(req.name) not in out, f"{path}: {req.name} pinned twice"
            out[canonicalize_name(req.name)] = spec.version
    return out


def our_requirements(engine: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["gpu"] + extras[engine]]


@pytest.mark.parametrize("engine", ENGINES)
def test_every_pin_satisfies_what_pyproject_asks(engine):
    path = constraints_file(engine)
    assert path.is_file(), f"no GPU environment for the {engine} extra: {path} is missing"
    pinned = pins(path)
    for req in our_requirements(engine):
        name = canonicalize_name(req.name)
        if name in pinned:
            assert req.specifier.contains(pinned[name], prereleases=True), (
                f"{path.name} pins {name}=={pinned[name]}, but pyproject.toml asks {req}")
    for name in (engine, "torch", "transformers"):
        assert name in pinned, f"{path.name} does not pin {name}"
    trainer = pins(TRAINER)
    assert {name: pinned.get(name) for name in trainer} == trainer, f"{path.name} does not hold {TRAINER.name}'s pins"
    for name in ("megatron-core", "transformer-engine", "transformer-engine-torch"):
        assert name in trainer, f"{TRAINER.name} does not pin {name}"


def _pip_environment() -> dict[str, str]:
    # The resolver sees the package index alone, not this machine's pip config, wheelhouse or caps: a local
    # torch-2.13.0+cpu wheel satisfies torch==2.13.0 and would hide the CUDA build's requirements.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_NO_INDEX", "PIP_EXTRA_INDEX_URL")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _constraint_texts(path: Path) -> list[str]:
    """A constraints file's text and those of the files it includes, in pip's order (not their paths)."""
    text = path.read_text()
    out = [text]
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-c "):
            out += _constraint_texts(path.parent / line[3:].strip())
    return out


def _local_listing(entry: str) -> list[list]:
    """Every file under a local index or find-links folder (``file://`` URL or path) with its size; [] for a URL."""
    folder = Path(urllib.parse.urlparse(entry).path if entry.startswith("file:") else entry)
    if "://" in entry and not entry.startswith("file:") or not folder.is_dir():
        return []
    return sorted([str((Path(top) / name).relative_to(folder)), (Path(top) / name).stat().st_size]
                  for top, _, names in os.walk(folder) for name in names)


def _pip_version() -> str:
    return importlib.metadata.version("pip")  # the pip of sys.executable, the one PipResolution runs


def resolve_key(args: Sequence[str], env: Mapping[str, str]) -> str:
    """sha256 of all that decides what ``pip <args>`` answers under ``env`` (the module docstring's list)."""
    inputs = {
        "args": [_constraint_texts(Path(arg)) if before in ("-c", "--constraint") else arg
                 for before, arg in zip(["", *args], args)],
        "pip": _pip_version(), "python": sys.version, "markers": default_environment(),
        "pip_env": {name: value for name, value in env.items() if name.startswith("PIP_")},
        "local": {entry: _local_listing(entry) for name in ("PIP_INDEX_URL", "PIP_FIND_LINKS")
                  for entry in env.get(name, "").split()},
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def resolve_cache_file(key: str) -> Path | None:
    """Where the resolution of ``key`` is kept; None when ``MEGATRON_RL_GPU_RESOLVE_CACHE=off``."""
    folder = os.environ.get(RESOLVE_CACHE_ENV) or str(Path.home() / ".cache" / "megatron-rl" / "gpu-resolve")
    return None if folder == "off" else Path(folder) / f"{key}.json"


def _kept_report(cache_file: Path | None) -> dict | None:
    try:
        if cache_file is None or time.time() - cache_file.stat().st_mtime > RESOLVE_CACHE_MAX_AGE_S:
            return None
        return json.loads(cache_file.read_text())
    except (OSError, ValueError):  # none kept, or a torn or unreadable file: resolve
        return None


def _keep_report(cache_file: Path | None, report: dict) -> None:
    if cache_file is None:
        return
    try:  # written whole, then renamed: a test reading it at the same time sees the old file or the new one
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(report))
        os.replace(partial, cache_file)
        for entry in cache_file.parent.glob("*.json"):  # entries no run reads again (~3 MB each)
            if time.time() - entry.stat().st_mtime > RESOLVE_CACHE_MAX_AGE_S:
                entry.unlink(missing_ok=True)
    except OSError:  # a read-only home: the next run resolves again
        pass


@dataclass
class PipResolution:
    """One `pip install --dry-run --report` running in the background, its output in a log file (a pipe would
    stall it while the test waits on another); or, with ``proc`` None, the report kept from an earlier run of the
    same key."""
    what: str
    cmd: list[str]
    proc: subprocess.Popen | None
    log: Path
    report_path: Path
    cache_file: Path | None = None
    kept: dict | None = None

    @classmethod
    def start(cls, folder: Path, what: str, *args: str) -> PipResolution:
        report_path, log = folder / "report.json", folder / "pip.log"
        cmd = [sys.executable, "-m", "pip", *PIP_FLAGS, "--report", str(report_path), *args]
        env = _pip_environment()
        cache_file = resolve_cache_file(resolve_key([*PIP_FLAGS, *args], env))
        kept = _kept_report(cache_file)
        if kept is not None:
            return cls(what, cmd, None, log, report_path, cache_file, kept)
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        return cls(what, cmd, proc, log, report_path, cache_file)

    def report(self) -> dict:
        if self.proc is None:
            return self.kept
        try:
            self.proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.skip(f"pip's resolver did not answer within 900 s for {self.what} (package index unreachable "
                        "or too slow)")
        output = self.log.read_text()
        if self.proc.returncode != 0 and any(marker in output for marker in UNREACHABLE):
            pytest.skip(f"the package index is unreachable, {self.what} was not resolved: {output[-500:]}")
        assert self.proc.returncode == 0, f"pip cannot resolve {self.what}:\n{' '.join(self.cmd)}\n{output[-4000:]}"
        report = json.loads(self.report_path.read_text())
        _keep_report(self.cache_file, report)
        return report

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _sdist_requires(name: str, version: str) -> list[str]:
    """Requires-Dist of a source package's PKG-INFO, read from its sdist on the package index (pip's own way,
    preparing the metadata, installs a CUDA torch into a build environment first: 266 s measured here)."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        request = urllib.request.Request(f"{index}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            files = json.load(answer)["files"]
        (sdist,) = [f for f in files if f["filename"] == f"{name.replace('-', '_')}-{version}.tar.gz"]
        with urllib.request.urlopen(urllib.parse.urljoin(f"{index}/{name}/", sdist["url"]), timeout=60) as answer:
            blob = answer.read()
    except OSError as exc:
        pytest.skip(f"the package index {index} is unreachable, {name} {version} was not read: {exc}")
    assert hashlib.sha256(blob).hexdigest() == sdist["hashes"]["sha256"], f"{sdist['filename']}: sha256 differs"
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        pkg_info = tar.extractfile(f"{name.replace('-', '_')}-{version}/PKG-INFO").read().decode()
    return email.parser.Parser().parsestr(pkg_info).get_all("Requires-Dist") or []


@pytest.fixture(scope="module")
def te_torch_needs() -> list[str]:
    """transformer-engine[pytorch] brings transformer-engine-torch, a source package compiled against the
    installed torch: its requirements are resolved in place of the package itself in every environment. Its
    setup.py (2.11.0, lines 164-166) requires the core package of torch.version.cuda's major,
    transformer_engine_cu<major>; the sdist's PKG-INFO names the CUDA of the machine that made it, so that line is
    the core package the environment pins, and the test checks torch's CUDA against it."""
    pinned = pins(TRAINER)
    (core,) = [name for name in pinned if name.startswith("transformer-engine-cu")]
    environment = default_environment()
    needs = [line for line in _sdist_requires("transformer-engine-torch", pinned["transformer-engine-torch"])
             if not canonicalize_name(Requirement(line).name).startswith("transformer-engine-cu")
             and (Requirement(line).marker is None or Requirement(line).marker.evaluate({**environment, "extra": ""}))]
    return [*needs, core]


@pytest.fixture(scope="module")
def resolutions(te_torch_needs, tmp_path_factory) -> Iterator[dict[str, PipResolution]]:
    """Every environment's resolution, asked at once: each is one to three minutes of round trips to the index."""
    running = {}
    for engine in ENGINES:
        path = constraints_file(engine)
        requirements = [str(req).replace("[pytorch]", "") if canonicalize_name(req.name) == "transformer-engine"
                        else str(req) for req in our_requirements(engine)]
        running[engine] = PipResolution.start(
            tmp_path_factory.mktemp(f"resolve-{engine}"), f"the {engine} GPU environment ({path.name} with "
            f".[gpu,{engine}])", "-c", str(path), *requirements, *te_torch_needs)
    yield running
    for resolution in running.values():
        resolution.stop()


@pytest.mark.slow  # one resolution of ~250 packages' metadata per environment, all at once (4-6 min, loaded machine)
@pytest.mark.parametrize("engine", ENGINES)
def test_pip_resolves_each_gpu_environment(engine, resolutions):
    path = constraints_file(engine)
    pinned = pins(path)
    report = resolutions[engine].report()
    resolved = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    for name, version in pinned.items():
        if name != "transformer-engine-torch":
            assert resolved.get(name) == version, f"{path.name}: {name} resolved {resolved.get(name)}, pinned {version}"
    # PyPI's CUDA build of torch (not a +cpu wheel), for the CUDA major of the Transformer Engine core package
    # pinned: the one transformer-engine-torch's setup.py picks from torch.version.cuda.
    assert Version(resolved["torch"]).local is None, f"{path.name}: torch {resolved['torch']} is not PyPI's CUDA build"
    (core,) = [name for name in pinned if name.startswith("transformer-engine-cu")]
    assert Version(resolved["cuda-toolkit"]).major == int(core.removeprefix("transformer-engine-cu")), (
        f"{path.name}: torch {resolved['torch']} brings cuda-toolkit {resolved['cuda-toolkit']}, TE's core is {core}")


def _install_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/install_gpu.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DRY_RUN": "1", "PYTHON": "venv-python"})


@pytest.mark.parametrize("engine", ENGINES)
def test_install_script_installs_each_environment_with_its_constraints(engine):
    proc = _install_script(engine)
    assert proc.returncode == 0, proc.stderr
    torch_first, checkout = proc.stdout.splitlines()
    assert torch_first.startswith(f"+ venv-python -m pip install -c constraints/gpu-{engine}.txt "), torch_first
    assert "torch" in torch_first.split() and "--no-build-isolation" not in torch_first
    # the checkout and TE's torch extension build against the torch just installed (pyproject.toml's build note)
    assert checkout == (f"+ venv-python -m pip install --no-build-isolation -c constraints/gpu-{engine}.txt "
                        f"-e .[gpu,{engine}]")


def test_install_script_names_the_environments_when_refusing_an_engine():
    proc = _install_script("hf")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("install_gpu.sh: no GPU environment 'hf' (constraints/gpu-hf.txt does not exist); "
                                   f"one of: {' '.join(ENGINES)}")


class _FakePip:
    """subprocess.Popen for PipResolution: answers ``returncode`` at once, writing a report of one package."""
    started: list[list[str]] = []
    returncode = 0

    def __init__(self, cmd, stdout, stderr, env) -> None:
        _FakePip.started.append(cmd)
        stdout.write("ResolutionImpossible" if self.returncode else "Would install torch-2.13.0")
        report = cmd[cmd.index("--report") + 1]
        Path(report).write_text(json.dumps({"install": [{"metadata": {"name": "torch", "version": "2.13.0"}}]}))

    def wait(self, timeout=None) -> int:
        return self.returncode

    def poll(self) -> int:
        return self.returncode


@pytest.fixture
def resolve_inputs(tmp_path, monkeypatch):
    """Two constraints files (one including the other), an empty find-links folder in pip's environment, the
    kept resolutions in tmp_path/cache, and pip faked."""
    folder = tmp_path / "clone" / "constraints"
    folder.mkdir(parents=True)
    (folder / "gpu-x.txt").write_text("-c gpu-base.txt\nx==1.0\n")
    (folder / "gpu-base.txt").write_text("torch==2.13.0\n")
    (tmp_path / "wheels").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "_pip_environment",
                        lambda: {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(tmp_path / "wheels")})
    monkeypatch.setenv(RESOLVE_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(subprocess, "Popen", _FakePip)
    monkeypatch.setattr(_FakePip, "started", [])
    return ["-c", str(folder / "gpu-x.txt"), "x[gpu]"]


def test_the_resolve_key_changes_with_every_input_and_not_with_the_clones_path(resolve_inputs, tmp_path, monkeypatch):
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(tmp_path / "wheels")}
    key = resolve_key(resolve_inputs, env)
    other_clone = tmp_path / "other" / "constraints"
    other_clone.mkdir(parents=True)
    for name in ("gpu-x.txt", "gpu-base.txt"):
        (other_clone / name).write_text((Path(resolve_inputs[1]).parent / name).read_text())
    assert resolve_key(["-c", str(other_clone / "gpu-x.txt"), "x[gpu]"], env) == key
    assert resolve_key([*resolve_inputs[:2], "x[gpu,more]"], env) != key  # a requirement, a pyproject extra
    assert resolve_key(resolve_inputs, {**env, "PIP_INDEX_URL": "https://example.org/simple"}) != key
    changed = []
    (other_clone / "gpu-base.txt").write_text("torch==2.14.1\n")  # an included file
    changed.append(resolve_key(["-c", str(other_clone / "gpu-x.txt"), "x[gpu]"], env))
    (tmp_path / "wheels" / "torch-2.13.0-py3-none-any.whl").write_bytes(b"w")  # the find-links listing
    changed.append(resolve_key(resolve_inputs, env))
    (tmp_path / "wheels" / "torch-2.13.0-py3-none-any.whl").unlink()
    pip_version = _pip_version
    monkeypatch.setattr(sys.modules[__name__], "_pip_version", lambda: "0.1")
    changed.append(resolve_key(resolve_inputs, env))
    monkeypatch.setattr(sys.modules[__name__], "_pip_version", pip_version)
    monkeypatch.setattr(sys, "version", sys.version + " (another build)")
    changed.append(resolve_key(resolve_inputs, env))
    assert key not in changed and len(set(changed)) == len(changed), changed


def test_a_kept_resolution_skips_pip_a_changed_input_or_an_old_one_runs_it(resolve_inputs, tmp_path):
    first = PipResolution.start(tmp_path, "x", *resolve_inputs)
    assert first.report()["install"][0]["metadata"]["version"] == "2.13.0"
    assert len(_FakePip.started) == 1 and first.cache_file.parent == tmp_path / "cache"
    second = PipResolution.start(tmp_path, "x", *resolve_inputs)  # another clean clone on this machine
    assert second.proc is None and second.report() == first.report() and len(_FakePip.started) == 1
    Path(resolve_inputs[1]).write_text("-c gpu-base.txt\nx==1.1\n")
    third = PipResolution.start(tmp_path, "x", *resolve_inputs)
    assert third.proc is not None and third.report() and len(_FakePip.started) == 2
    old = time.time() - RESOLVE_CACHE_MAX_AGE_S - 60
    os.utime(third.cache_file, (old, old))
    os.utime(first.cache_file, (old, old))
    fourth = PipResolution.start(tmp_path, "x", *resolve_inputs)
    assert fourth.proc is not None and fourth.report() and len(_FakePip.started) == 3
    # the old entry read again is renewed, the other old one removed
    assert [f.name for f in (tmp_path / "cache").iterdir()] == [third.cache_file.name]


def test_a_failed_resolution_is_not_kept(resolve_inputs, tmp_path, monkeypatch):
    monkeypatch.setattr(_FakePip, "returncode", 1)
    with pytest.raises(AssertionError, match="pip cannot resolve"):
        PipResolution.start(tmp_path, "x", *resolve_inputs).report()
    assert not (tmp_path / "cache").exists()
    monkeypatch.setattr(_FakePip, "returncode", 0)
    PipResolution.start(tmp_path, "x", *resolve_inputs).report()
    assert len(_FakePip.started) == 2 and len(list((tmp_path / "cache").iterdir())) == 1
