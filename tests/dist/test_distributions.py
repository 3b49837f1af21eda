"""The built distributions, installed the way a user installs them (`make test-dist`, after `make dist`).

- The SDK's wheel alone, in a fresh virtualenv, brings none of the service-only packages and no
  ``caller_memory.service``, and its public surface (``testing.service()`` included) drives the service's wheel,
  installed in another virtualenv with ``--no-index --find-links dist/`` for our own packages.
- A framework example runs from the SDK's wheel with its extra.
- Both install from git with a subdirectory (a ``git+file://`` URL: offline).
- Both carry the one version and the Apache-2.0 licence.

Third-party packages come from the package index as usual (uv's cache makes that quick); our two never do.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"
UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
# What only the service needs (SPEC section 19): installing the SDK must bring none of them.
SERVICE_ONLY = {"redis", "hiredis", "cryptography", "obstore", "apscheduler", "prometheus-client",
                "standardwebhooks", "mcp"}  # fmt: skip

pytestmark = pytest.mark.timeout(600)


def version() -> str:
    namespace: dict[str, str] = {}
    exec((ROOT / "sdk" / "_version.py").read_text(), namespace)
    return namespace["__version__"]


def wheel(name: str) -> Path:
    found = sorted(DIST.glob(f"{name}-{version()}-py3-none-any.whl"))
    assert found, f"no {name} wheel of version {version()} in dist/: run `make dist` first"
    return found[0]


def wheel_metadata(path: Path) -> email.message.Message:
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


def run(*command: str | Path, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=540, check=False
    )
    assert done.returncode == 0, (
        f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def virtualenv(path: Path) -> Path:
    assert UV is not None, "uv is not installed (make install-test installs it)"
    run(UV, "venv", "--quiet", "--python", sys.executable, path)
    return path / "bin" / "python"


def install(python: Path, *requirements: str | Path) -> None:
    assert UV is not None
    run(UV, "pip", "install", "--quiet", "--python", python, *requirements)


def installed(python: Path) -> set[str]:
    listing = run(
        python,
        "-c",
        "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))",
        # Not the repository: a folder there (a stale *.egg-info) would be listed too.
        cwd=python.parent,
        env=clean_environment(),
    )
    return {line.strip().lower().replace("_", "-") for line in listing.splitlines() if line.strip()}


def clean_environment() -> dict[str, str]:
    """This process's environment without what would let a subprocess find the repository's own packages."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "VIRTUAL_ENV"} and not k.startswith("CALLER_MEMORY_")
    }


@pytest.fixture(scope="module")
def service_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The service's wheel in its own virtualenv: its third-party dependencies from the index, then our two
    packages with --no-index --find-links dist/ (so neither could come from anywhere else)."""
    python = virtualenv(tmp_path_factory.mktemp("service") / "venv")
    meta = wheel_metadata(wheel("caller_memory"))
    third_party = [
        r
        for r in meta.get_all("Requires-Dist") or []
        if "extra ==" not in r and not r.startswith("caller-memory-sdk")
    ]
    install(python, *third_party)
    assert UV is not None
    run(
        UV,
        "pip",
        "install",
        "--quiet",
        "--python",
        python,
        "--no-index",
        "--find-links",
        DIST,
        "caller-memory",
    )
    return python


@pytest.fixture(scope="module")
def sdk_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SDK's wheel alone in a fresh virtualenv."""
    python = virtualenv(tmp_path_factory.mktemp("sdk") / "venv")
    install(python, wheel("caller_memory_sdk"))
    return python


def test_both_distributions_carry_the_one_version_and_the_licence() -> None:
    sdk, service = wheel_metadata(wheel("caller_memory_sdk")), wheel_metadata(wheel("caller_memory"))
    assert sdk["Name"] == "caller-memory-sdk" and service["Name"] == "caller-memory"
    assert sdk["Version"] == service["Version"] == version()
    assert f"caller-memory-sdk=={version()}" in (service.get_all("Requires-Dist") or [])
    for meta, path in ((sdk, wheel("caller_memory_sdk")), (service, wheel("caller_memory"))):
        assert meta["License-Expression"] == "Apache-2.0"
        with zipfile.ZipFile(path) as archive:
            (licence,) = [n for n in archive.namelist() if n.endswith("licenses/LICENSE")]
            assert archive.read(licence) == (ROOT / "LICENSE").read_bytes()
    assert (ROOT / "sdk" / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()


def test_each_wheel_holds_its_own_package_and_nothing_else() -> None:
    with zipfile.ZipFile(wheel("caller_memory_sdk")) as archive:
        sdk_files = [n for n in archive.namelist() if ".dist-info/" not in n]
    with zipfile.ZipFile(wheel("caller_memory")) as archive:
        service_files = [n for n in archive.namelist() if ".dist-info/" not in n]
    assert sdk_files and all(n.startswith("caller_memory/sdk/") for n in sdk_files), sdk_files
    assert "caller_memory/sdk/py.typed" in sdk_files and "caller_memory/sdk/testing.py" in sdk_files
    assert not any(n.endswith(("pyproject.toml", "README.md")) for n in sdk_files)
    assert service_files and all(n.startswith("caller_memory/service/") for n in service_files)
    assert "caller_memory/service/storage/sqlite/schema.sql" in service_files
    assert any(n.endswith(".lua") for n in service_files) and any(n.endswith(".js") for n in service_files)
    # No build folder was left in a package folder, and no __init__ makes caller_memory a regular package.
    assert not any(p.suffix == ".egg-info" or p.name == "build" for p in (ROOT / "sdk").iterdir())
    assert "caller_memory/__init__.py" not in sdk_files + service_files


def test_the_sdk_wheel_alone_brings_none_of_the_service(sdk_python: Path) -> None:
    names = installed(sdk_python)
    assert "caller-memory-sdk" in names and "caller-memory" not in names
    assert not names & SERVICE_ONLY, names & SERVICE_ONLY
    found = run(
        sdk_python,
        "-c",
        "import importlib.util as u; print(u.find_spec('caller_memory.service'))",
        env=clean_environment(),
    )
    assert found.strip() == "None"


def test_the_sdk_wheel_drives_the_service_wheel_through_its_public_surface(
    sdk_python: Path, service_python: Path, tmp_path: Path
) -> None:
    out = run(
        sdk_python,
        Path(__file__).parent / "sdk_surface.py",
        service_python,
        cwd=tmp_path,
        env=clean_environment(),
    )
    assert out.splitlines()[-1] == "surface ok", out


def test_testing_service_names_what_to_install_when_the_service_is_absent(
    sdk_python: Path, tmp_path: Path
) -> None:
    code = (
        "import asyncio\n"
        "from caller_memory.sdk.testing import ServiceNotInstalledError, service\n"
        "async def main():\n"
        "    try:\n"
        "        async with service():\n"
        "            raise SystemExit('started without the service')\n"
        "    except ServiceNotInstalledError as error:\n"
        "        print(error)\n"
        "asyncio.run(main())\n"
    )
    out = run(sdk_python, "-c", code, cwd=tmp_path, env=clean_environment())
    assert "caller-memory" in out and "pip install ./sdk ./" in out, out


def test_a_framework_example_runs_from_the_sdk_wheel_with_its_extra(tmp_path: Path) -> None:
    python = virtualenv(tmp_path / "venv")
    sdk_wheel = wheel("caller_memory_sdk")
    install(python, f"caller-memory-sdk[pipecat] @ {sdk_wheel.as_uri()}")
    assert UV is not None
    run(UV, "pip", "install", "--quiet", "--python", python, "--find-links", DIST, wheel("caller_memory"))
    out = run(python, ROOT / "examples" / "pipecat_bot.py", "--demo", cwd=tmp_path, env=clean_environment())
    assert "agent: Welcome back, Ada!" in out.split("--- call-2")[1], out


@pytest.fixture(scope="module")
def git_repository(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A git repository of the working tree's tracked files (what a clone holds), to install from offline."""
    repo = tmp_path_factory.mktemp("git") / "caller-memory"
    tracked = run("git", "ls-files", "-z").split("\0")
    for name in filter(None, tracked):
        source = ROOT / name
        if source.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name, follow_symlinks=False)
    for command in (
        ("init", "--quiet"),
        ("add", "-A"),
        ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "snapshot"),
    ):
        run("git", *command, cwd=repo)
    yield repo


def test_both_install_from_git_with_a_subdirectory(git_repository: Path, tmp_path: Path) -> None:
    python = virtualenv(tmp_path / "venv")
    url = git_repository.as_uri()
    install(python, f"caller-memory-sdk @ git+{url}#subdirectory=sdk", f"caller-memory @ git+{url}")
    names = installed(python)
    assert {"caller-memory", "caller-memory-sdk"} <= names
    out = run(
        python,
        "-c",
        "import caller_memory.sdk as s, caller_memory.service; print(s.__version__)",
        cwd=tmp_path,
        env=clean_environment(),
    )
    assert out.strip() == version()
    assert "serve" in run(python.parent / "caller-memory", "--help", cwd=tmp_path, env=clean_environment())
