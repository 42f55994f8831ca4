"""constraints.txt, the versions `make setup` installs: it must pin everything the project requires."""

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
EXTRAS_MAKE_INSTALLS = ("dev", "triton")


def _lock() -> dict[str, str]:
    pins = {}
    for number, line in enumerate((ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version and " " not in line, f"constraints.txt:{number}: expected NAME==VERSION, got {line!r}"
        pins[canonicalize_name(name)] = version
    return pins


def _applies(requirement: Requirement, extras=("",)) -> bool:
    return requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in extras)


def _project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = list(project["dependencies"])
    for extra in EXTRAS_MAKE_INSTALLS:
        wanted += project["optional-dependencies"][extra]
    return [r for r in map(Requirement, wanted) if _applies(r)]


def test_the_lock_pins_every_requirement_within_its_declared_range():
    pins = _lock()
    unpinned = [str(r) for r in _project_requirements() if canonicalize_name(r.name) not in pins]
    assert not unpinned, f"constraints.txt pins none of {unpinned}: run `make lock`"
    # What `make setup` installs besides the requirements: pip itself, the editable build's backend.
    assert {"pip", "setuptools"} <= set(pins), "constraints.txt must pin pip and setuptools too: run `make lock`"
    outside = [f"{r} (locked {pins[canonicalize_name(r.name)]})" for r in _project_requirements()
               if not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)]
    assert not outside, f"constraints.txt pins versions pyproject.toml refuses: {outside}"


def test_the_lock_and_the_makefile_pin_the_same_torch():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    found = re.findall(r"^TORCH\s*:=\s*torch==(\S+)$", makefile, re.MULTILINE)
    assert len(found) == 1, f"expected one `TORCH := torch==VERSION` line in the Makefile, found {found}"
    assert _lock()["torch"] == found[0]


def test_the_lock_holds_what_its_pinned_packages_require_here():
    # Checked against the installed packages' own metadata: a package the lock pins that needs one
    # it does not pin would be resolved afresh on a clean machine, which is what the lock prevents.
    pins = _lock()
    missing = []
    for name in pins:
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        missing += [f"{name} needs {r}" for r in map(Requirement, requires)
                    if _applies(r) and canonicalize_name(r.name) not in pins]
    assert not missing, f"constraints.txt is not closed: {missing}; run `make lock`"


def test_every_pip_install_of_make_setup_is_held_to_the_lock():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    installs = [line.strip() for line in makefile.splitlines() if "$(PY) -m pip install" in line]
    assert len(installs) >= 4, installs  # pip itself, torch, ninja, the project
    unheld = [line for line in installs if "-c $(LOCK)" not in line]
    assert not unheld, f"pip installs in make setup not held to constraints.txt: {unheld}"
    editable = [line for line in installs if " -e " in line]
    # -c does not reach the isolated build environment of the editable install: its backend too.
    assert editable and all("--build-constraint $(LOCK)" in line for line in editable), editable
