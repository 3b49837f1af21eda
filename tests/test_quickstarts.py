"""The README's quick starts run as written: their code blocks are taken from the README by heading and run,
the shell steps against the service started the way `make run` starts it, the agent as the README shows it,
the framework examples with the command it gives. Installation lines are checked, not run: this suite runs
in the repository's virtualenv, which has the SDK, the service and both extras (the built wheels are tested
on their own, in tests/dist)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.test_walkthrough import dev_service

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
VENV = Path(sys.executable).parent.parent


def quick_start(heading: str) -> str:
    """The text of one quick start: from its heading to the next heading."""
    text = README.read_text()
    start = text.index(f"\n### {heading}\n")
    end = re.compile(r"^#{2,3} ", re.MULTILINE).search(text, start + 1 + len(heading) + 5)
    assert end is not None
    return text[start : end.start()]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def commented(line: str) -> tuple[str, str]:
    """A shell line and what its comment says it prints (or explains)."""
    command, _, comment = line.partition("#")
    return command.strip(), comment.strip()


def workspace(tmp_path: Path) -> dict[str, str]:
    """A folder like a clone's (its .venv this suite's, its examples the repository's), and an environment
    whose `python` is that virtualenv's, without this process's Caller Memory settings."""
    (tmp_path / ".venv").symlink_to(VENV)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALLER_MEMORY_")}
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_make_run_is_the_script_the_quick_starts_are_tested_with() -> None:
    recipe = re.search(r"^run:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert recipe is not None and "./scripts/run-dev" in recipe.group(1)


def test_the_service_and_sdk_quick_starts_run_as_written(tmp_path: Path) -> None:
    """`make run`; the first request, a project and an agent token; then the agent of the SDK's quick start,
    saved as agent.py and run twice: the second call is greeted by the name the first one stored."""
    service, sdk = quick_start("Run the service"), quick_start("The SDK in agent code")
    make_run, setup = blocks(service, "sh")
    assert commented(make_run.strip())[0] == "make run"
    assert "pip install ./sdk" in sdk
    [agent] = blocks(sdk, "python")
    [calls] = blocks(sdk, "sh")
    env = workspace(tmp_path)
    with dev_service(tmp_path) as (cm, _):
        port = cm.rsplit(":", 1)[1]
        script = setup.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        ran = subprocess.run(
            ["bash", "-euc", script + '\necho "AGENT=$AGENT"'],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 0, ran.stderr
        printed = ran.stdout.splitlines()
        for line in setup.splitlines():
            if line.startswith("# "):  # an answer the README shows
                assert line[2:] in printed, (line, printed)
        token = printed[-1].removeprefix("AGENT=")
        assert re.fullmatch(r"cm_[0-9a-f]{12}_\S+", token), printed
        (tmp_path / "agent.py").write_text(agent.replace("127.0.0.1:8080", f"127.0.0.1:{port}"))
        lines = [commented(line) for line in calls.strip().splitlines()]
        assert [command for command, _ in lines] == ["python agent.py call-1", "python agent.py call-2"]
        for command, says in lines:
            call = subprocess.run(
                ["bash", "-euc", command],
                cwd=tmp_path,
                env=env | {"AGENT": token},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert call.returncode == 0, call.stderr
            assert call.stdout.splitlines()[0] == says, call.stdout
        assert "remembered: ('caller_name',)" in call.stdout


@pytest.mark.parametrize(
    ("heading", "extra", "example"),
    [("Pipecat", "pipecat", "pipecat_bot.py"), ("LiveKit Agents", "livekit", "livekit_agent.py")],
)
def test_a_framework_quick_start_shows_the_examples_lines_and_its_demo_runs(
    heading: str, extra: str, example: str, tmp_path: Path
) -> None:
    """The drop-in lines are the example's own (each line of the README's snippet is in the example), the
    extra it installs exists, and its demo, run with the README's command, greets the second call by name."""
    text = quick_start(heading)
    [snippet] = blocks(text, "python")
    source = " ".join((ROOT / "examples" / example).read_text().split())
    for line in snippet.splitlines():
        code = line.split("  #")[0].strip()
        if code and code != "...":
            assert code in source, f"{code!r} is not in examples/{example}"
    extras = tomllib.loads((ROOT / "sdk" / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra in extras
    assert f'pip install "./sdk[{extra}]"' in text
    install, demo = (commented(line) for line in blocks(text, "sh")[0].strip().splitlines())
    assert install[0] == f'.venv/bin/pip install -e "./sdk[{extra}]"'
    assert demo[0] == f".venv/bin/python examples/{example} --demo"
    ran = subprocess.run(
        ["bash", "-euc", demo[0]],
        cwd=tmp_path,
        env=workspace(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    greeting = re.search(r'"(.+)"', demo[1])
    assert greeting is not None, demo[1]
    _, first, second = ran.stdout.split("--- call")
    assert greeting[1] not in first and f"agent: {greeting[1]}" in second, ran.stdout


def test_each_quick_start_is_short() -> None:
    for heading in ("Run the service", "The SDK in agent code", "Pipecat", "LiveKit Agents"):
        assert len(quick_start(heading).strip().splitlines()) <= 33, heading
    assert len(README.read_text().splitlines()) < 200
