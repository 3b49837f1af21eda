"""The documentation holds together: every relative link (file and heading) resolves, and every setting the
service reads from its environment is in the operations guide's table exactly once."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "bench/README.md",
    ROOT / "deploy/README.md",
]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup dropped, spaces to '-', punctuation removed."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower()).replace("`", "").replace("*", "")
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def _lines_outside_code(path: Path) -> list[tuple[int, str]]:
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in _lines_outside_code(path):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slug = _slug(match.group(1))
            seen[slug] = seen.get(slug, -1) + 1
    return {slug if n == 0 else f"{slug}-{n}" for slug, count in seen.items() for n in range(count + 1)}


def broken_links(paths: list[Path], root: Path = ROOT) -> list[str]:
    broken = []
    for path in paths:
        for number, line in _lines_outside_code(path):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http:, https:, mailto:
                file, _, fragment = target.partition("#")
                destination = (path.parent / file).resolve() if file else path.resolve()
                if not destination.exists():
                    broken.append(f"{path.relative_to(root)}:{number}: {target}: no such file")
                elif fragment and destination.suffix == ".md" and fragment not in _anchors(destination):
                    broken.append(f"{path.relative_to(root)}:{number}: {target}: no heading #{fragment}")
    return broken


def test_every_relative_link_resolves() -> None:
    assert broken_links(DOCS) == []


def test_the_link_check_catches_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n[ok](#a-title) [ok](other.md) [gone](missing.md) [no heading](#nowhere)\n")
    (tmp_path / "other.md").write_text("x")
    assert [b.split(": ", 1)[1] for b in broken_links([page], tmp_path)] == [
        "missing.md: no such file",
        "#nowhere: no heading #nowhere",
    ]


def settings_table(path: Path) -> list[str]:
    """The settings named by the rows of the table under the page's "Every setting" heading."""
    text = path.read_text()
    start = text.index("\n### Every setting\n")
    end = text.index("\n#", start + 1)
    return re.findall(r"^\| `(CALLER_MEMORY_[A-Z_]+)` \|", text[start:end], re.MULTILINE)


def test_every_setting_the_service_reads_is_in_the_operations_guides_table_once() -> None:
    read = set(re.findall(r'"(CALLER_MEMORY_[A-Z_]+)"', (ROOT / "service/config.py").read_text()))
    rows = settings_table(ROOT / "docs/operations.md")
    assert read, "no setting found in service/config.py: the test would prove nothing"
    assert sorted(rows) == sorted(set(rows)), "a setting has two rows"
    assert set(rows) == read


ARCHITECTURE = ROOT / "docs/architecture.md"
#: Rooms part three adds; the notes name them before they exist.
LATER = ("platforms/", "proxy/", "mcp/")


def test_every_path_the_architecture_notes_name_exists() -> None:
    named = set(re.findall(r"`((?:domain|storage|http|sdk|service)/[\w./<>-]*)`", ARCHITECTURE.read_text()))
    assert len(named) > 10
    missing = []
    for path in sorted(named):
        if "<" in path or path.startswith(LATER):
            continue  # a pattern (storage/<backend>/...) or a room of part three
        where = ROOT / path if path.startswith(("sdk/", "service/")) else ROOT / "service" / path
        if not where.exists():
            missing.append(path)
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_domain_floors_in_the_notes_are_the_contract_the_build_checks() -> None:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (floors,) = [c["layers"] for c in contracts if c["id"] == "domain-floors"]
    checked = [sorted(room.strip() for room in layer.split("|")) for layer in floors]
    table = re.findall(r"^\| (\d+) \| (.+) \|$", ARCHITECTURE.read_text(), re.MULTILINE)
    written = [
        sorted(room.strip(" `/") for room in re.sub(r" \(.*?\)", "", rooms).split(", ")) for _, rooms in table
    ]
    assert written == checked
