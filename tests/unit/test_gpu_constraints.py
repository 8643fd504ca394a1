"""constraints/gpu-<engine>.txt: one GPU environment per rollout engine that pip's resolver accepts (issues 14,
49). The engines' torch pins cannot agree (sglang 0.5.23: torch 2.14.1, xgrammar 0.2.7, flashinfer 0.7.2; vllm
0.32.0: torch 2.13.0, xgrammar 0.2.8, flashinfer 0.7.0.post1), so each environment is its engine's pins plus the
trainer's (constraints/gpu-megatron.txt: Megatron-Core, Transformer Engine), both on CUDA 13.0 wheels. The pins
are checked against pyproject.toml offline; the resolver is asked with metadata only (``pip install --dry-run
--report``: no wheel is installed, and PyPI serves wheel metadata without the wheel) and the test skips, saying
so, when the index is unreachable."""
from __future__ import annotations

import email.parser
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Iterator
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


@dataclass
class PipResolution:
    """One `pip install --dry-run --report` running in the background, its output in a log file (a pipe would
    stall it while the test waits on another)."""
    what: str
    cmd: list[str]
    proc: subprocess.Popen
    log: Path
    report_path: Path

    @classmethod
    def start(cls, folder: Path, what: str, *args: str) -> PipResolution:
        report_path, log = folder / "report.json", folder / "pip.log"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--prefer-binary",
               "--disable-pip-version-check", "--report", str(report_path), *args]
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_pip_environment())
        return cls(what, cmd, proc, log, report_path)

    def report(self) -> dict:
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
        return json.loads(self.report_path.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
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
