"""constraints/gpu.txt: one GPU stack (sglang 0.5.23, its torch 2.14.1, Transformer Engine, Megatron-Core,
our extras) that pip's resolver accepts (issue 14). The pins are checked against pyproject.toml offline;
the resolver is asked with metadata only (``pip install --dry-run --report``: no wheel is installed, and
PyPI serves wheel metadata without the wheel) and the test skips, saying so, when the index is unreachable."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints" / "gpu.txt"
UNREACHABLE = ("Network is unreachable", "Failed to establish a new connection", "Temporary failure in name "
               "resolution", "Could not fetch URL", "No matching distribution found for sglang==",
               "Name or service not known", "Connection refused", "timed out")


def pins() -> dict[str, str]:
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{CONSTRAINTS}: {line!r} is not an exact pin"
            out[canonicalize_name(req.name)] = spec.version
    return out


def our_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["gpu"] + extras["sglang"]]


def test_every_pin_satisfies_what_pyproject_asks():
    pinned = pins()
    for req in our_requirements():
        name = canonicalize_name(req.name)
        if name in pinned:
            assert req.specifier.contains(pinned[name], prereleases=True), (
                f"constraints/gpu.txt pins {name}=={pinned[name]}, but pyproject.toml asks {req}")
    for name in ("torch", "sglang", "megatron-core", "transformer-engine", "transformer-engine-torch", "transformers"):
        assert name in pinned, f"constraints/gpu.txt does not pin {name}"


def _pip_report(tmp_path: Path, *args: str) -> dict:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--prefer-binary",
           "--disable-pip-version-check", "--report", str(report), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("pip's resolver did not answer within 900 s (package index unreachable or too slow)")
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and any(marker in output for marker in UNREACHABLE):
        pytest.skip(f"the package index is unreachable, the GPU stack was not resolved: {output[-500:]}")
    assert proc.returncode == 0, f"pip cannot resolve the GPU stack:\n{' '.join(cmd)}\n{output[-4000:]}"
    return json.loads(report.read_text())


@pytest.mark.slow  # one resolution of ~250 packages' metadata (a minute or two)
def test_pip_resolves_the_gpu_stack(tmp_path):
    pinned = pins()
    # transformer-engine[pytorch] brings transformer-engine-torch, a source package compiled against the
    # installed torch: its requirements are read first (--no-deps: its metadata only), then the whole set
    # is resolved with them in place of the package itself, metadata only.
    te_torch = _pip_report(tmp_path, "--no-deps", f"transformer-engine-torch=={pinned['transformer-engine-torch']}")
    (item,) = te_torch["install"]
    environment = default_environment()
    te_torch_needs = [
        line for line in item["metadata"].get("requires_dist", [])
        if Requirement(line).marker is None or Requirement(line).marker.evaluate({**environment, "extra": ""})
    ]
    requirements = []
    for req in our_requirements():
        if canonicalize_name(req.name) == "transformer-engine":
            req = Requirement(str(req).replace("[pytorch]", ""))
        requirements.append(str(req))
    report = _pip_report(tmp_path, "-c", str(CONSTRAINTS), *requirements, *te_torch_needs)
    resolved = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    for name, version in pinned.items():
        if name != "transformer-engine-torch":
            assert resolved.get(name) == version, f"{name}: resolved {resolved.get(name)}, pinned {version}"
    assert any(canonicalize_name(Requirement(line).name) == "transformer-engine-cu13" for line in te_torch_needs)
