"""The lowest versions of the direct dependencies that pyproject.toml allows (`make test-floors`).

    python scripts/floors.py requirements [TOOL ...]   one requirement a line: every runtime dependency pinned
                                                       to its floor (``name[extras]==floor``), then each TOOL as
                                                       the ``test`` extra declares it (normal resolution)
    python scripts/floors.py check                     exit 1 unless each runtime dependency is installed at
                                                       exactly its floor (run with the floors env's python)

Every runtime dependency must declare a floor with ``>=``: a floor is a promise that the code works with that
release, and `make test-floors` is what keeps it. The standard library only (tomllib): this runs before any
package is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The service's project file lists its runtime dependencies for its build hook (hatch_build.py adds the SDK);
# the SDK's project file lists its own.
PYPROJECT = ROOT / "pyproject.toml"
SDK_PYPROJECT = ROOT / "sdk" / "pyproject.toml"
# name, optional [extras], then the specifiers up to an optional ; marker (PEP 508, without URLs).
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*?)\s*(;.*)?$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> tuple[str, ...]:
    """8.0 and 8.0.0 are the same release."""
    parts = version.split("+")[0].split(".")
    while len(parts) > 1 and parts[-1] == "0":
        parts.pop()
    return tuple(parts)


def runtime_dependencies() -> list[str]:
    """The runtime dependencies of both distributions (the service's, then the SDK's not already listed)."""
    service = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["hatch"]["metadata"]["hooks"][
        "custom"
    ]
    sdk = tomllib.loads(SDK_PYPROJECT.read_text(encoding="utf-8"))["project"]
    return [*service["dependencies"], *sdk["dependencies"]]


def floors(requirements: list[str]) -> list[tuple[str, str, str, str]]:
    """(name, extras, floor, marker) of each runtime dependency; a dependency without ``>=`` is an error, and so
    is one declared by both distributions with different floors."""
    found: list[tuple[str, str, str, str]] = []
    seen: dict[str, str] = {}
    for requirement in requirements:
        match = REQUIREMENT.match(requirement)
        if match is None:
            sys.exit(f"floors.py: cannot read the dependency {requirement!r}")
        name, extras, specifiers, marker = match.groups()
        lows = [s.strip()[2:].strip() for s in specifiers.split(",") if s.strip().startswith(">=")]
        if len(lows) != 1:
            sys.exit(f"floors.py: {requirement!r} declares no single '>=' floor")
        key = canonical(name)
        if key in seen:
            if seen[key] != lows[0]:
                sys.exit(
                    f"floors.py: {name} has the floor {seen[key]} in one project file and {lows[0]} in the other"
                )
            continue
        seen[key] = lows[0]
        found.append((name, extras or "", lows[0], marker or ""))
    return found


def test_requirements(project: dict[str, object], tools: list[str]) -> list[str]:
    declared = {}
    for requirement in project["optional-dependencies"]["test"]:  # type: ignore[index]
        match = REQUIREMENT.match(requirement)
        assert match is not None, requirement
        declared[canonical(match.group(1))] = requirement
    missing = [tool for tool in tools if canonical(tool) not in declared]
    if missing:
        sys.exit(f"floors.py: not in the test extra of pyproject.toml: {', '.join(missing)}")
    return [declared[canonical(tool)] for tool in tools]


def main(argv: list[str]) -> int:
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    if command == "requirements":
        for name, extras, floor, marker in floors(runtime_dependencies()):
            print(f"{name}{extras}=={floor}{marker}")
        for line in test_requirements(project, args):
            print(line)
        return 0
    if command == "check":
        wrong = []
        for name, _, floor, _ in floors(runtime_dependencies()):
            try:
                installed = metadata.version(name)
            except metadata.PackageNotFoundError:
                installed = "missing"
            if release(installed) != release(floor):
                wrong.append(f"{name}: floor {floor}, installed {installed}")
            else:
                print(f"  {name}=={installed}")
        if wrong:
            print("floors.py: not at the declared floor:\n  " + "\n  ".join(wrong), file=sys.stderr)
            return 1
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
