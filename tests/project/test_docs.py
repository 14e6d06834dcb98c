"""The docs stay true to the tree: a README a newcomer reads in five minutes, links that resolve, and an
architecture page that names every module there is and none that is gone."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("core", "server", "client", "tools", "harness", "demos", "integrations", "data")
README_LINES = 250


def modules(root: pathlib.Path = ROOT) -> set[str]:
    """Every .py file under the packages' folders, subpackages included, as a path from the root."""
    return {
        p.relative_to(root).as_posix()
        for folder in PACKAGES
        for p in (root / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def layout_mismatch(page: str, root: pathlib.Path = ROOT) -> tuple[set[str], set[str]]:
    """(modules the page's Layout section does not name, modules it names that do not exist).

    NOTE: only the Layout section counts, so a module named in passing elsewhere on the page
    does not stand in for its row.
    """
    _, found, layout = page.partition("\n## Layout\n")
    if not found:
        raise ValueError("docs/architecture.md has no '## Layout' section")
    layout = re.split(r"^## ", layout, flags=re.M)[0]
    folders = "|".join(PACKAGES)
    named = set(re.findall(rf"`((?:{folders})/[\w/]+\.py)`", layout))
    have = modules(root)
    return have - named, named - have


def test_the_architecture_page_names_every_module() -> None:
    missing, gone = layout_mismatch((ROOT / "docs" / "architecture.md").read_text())
    assert not missing, f"docs/architecture.md does not name {sorted(missing)}: add a row for each"
    assert not gone, f"docs/architecture.md names modules that do not exist: {sorted(gone)}"


def test_the_layout_check_can_fail(tmp_path: pathlib.Path) -> None:
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "core" / "a.py").write_text("")
    (tmp_path / "core" / "b.py").write_text("")
    (tmp_path / "core" / "sub").mkdir()
    (tmp_path / "core" / "sub" / "c.py").write_text("")
    page = (
        "# Architecture\n\nIn passing: `core/b.py`.\n\n## Layout\n\n"
        "| `core/a.py` | x |\n| `core/gone.py` | y |\n\n## After\n\n`core/sub/c.py`\n"
    )
    assert layout_mismatch(page, tmp_path) == ({"core/b.py", "core/sub/c.py"}, {"core/gone.py"})


def test_the_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_LINES, f"README.md has {n} lines; move what is not the first five minutes to docs/"


def broken_links(root: pathlib.Path = ROOT) -> list[str]:
    """Relative links in README.md and docs/*.md whose file (or heading) does not exist."""
    bad = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(root)}: {target}")
            elif anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)}
                if anchor not in slugs:
                    bad.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return bad


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def test_every_relative_link_resolves() -> None:
    assert broken_links() == []


def test_the_link_check_can_fail(tmp_path: pathlib.Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Its part\n")
    (tmp_path / "README.md").write_text("[ok](docs/a.md#its-part) [gone](docs/b.md) [no anchor](docs/a.md#other)\n")
    assert broken_links(tmp_path) == ["README.md: docs/b.md", "README.md: docs/a.md#other (no such heading)"]


OUTSIDE = re.compile(r"\.\./shared|\.\./\.\.|/work/shared|SPEC\.md|(?<![\w/.-])reference/")


def outside_references(root: pathlib.Path = ROOT) -> list[str]:
    """Paths in the docs, the tests and the packages that lead out of the repository."""
    pages = [*root.glob("*.md"), *(root / "docs").glob("*.md"), *(root / "deploy").glob("*.md")]
    code = [*(root / "tests").glob("*.py"), *(p for f in PACKAGES for p in (root / f).rglob("*.py"))]
    bad = []
    for path in sorted(pages + code):
        if path.name == "test_docs.py":  # it names the patterns it looks for
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            bad += [f"{path.relative_to(root)}:{n}: {m.group(0)}" for m in OUTSIDE.finditer(line)]
    return bad


def test_nothing_points_outside_the_repository() -> None:
    """The project speaks of itself: no link or path that leaves the repository."""
    assert outside_references() == []


def test_the_outside_check_can_fail(tmp_path: pathlib.Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "docs" / "a.md").write_text("fine: docs/guarantees.md\nsee ../shared/notes\n")
    (tmp_path / "tests" / "test_x.py").write_text('"""Checked against reference/spdl and SPEC.md."""\n')
    assert outside_references(tmp_path) == [
        "docs/a.md:2: ../shared",
        "tests/test_x.py:1: reference/",
        "tests/test_x.py:1: SPEC.md",
    ]


# ------------------------------------------------------------------ the front pages as things stand


def guarantees(root: pathlib.Path = ROOT) -> list[tuple[str, str]]:
    """(G<n>, its name) of every guarantee docs/guarantees.md states, in order."""
    return re.findall(r"^### (G\d+) (.+)$", (root / "docs" / "guarantees.md").read_text(), re.M)


def unnamed_guarantees(page: str, stated: list[tuple[str, str]]) -> list[str]:
    """What a front page misses of the guarantees as they stand: their range ("G1–G14") and each by name
    ("exactly once (G1)"), the page's line breaks read as spaces."""
    text = " ".join(page.split())
    missing = [] if f"G1–{stated[-1][0]}" in text else [f"the range G1–{stated[-1][0]}"]
    return missing + [f"{name} ({g})" for g, name in stated if f"{name} ({g})" not in text]


def test_the_front_pages_name_the_guarantees_as_they_stand() -> None:
    stated = guarantees()
    assert len(stated) >= 14 and [g for g, _ in stated] == [f"G{i}" for i in range(1, len(stated) + 1)]
    for page in ("README.md", "docs/index.md"):
        assert unnamed_guarantees((ROOT / page).read_text(), stated) == [], page


def test_the_guarantee_check_can_fail() -> None:
    stated = [("G1", "exactly once"), ("G2", "determinism"), ("G3", "durability")]
    assert unnamed_guarantees("G1–G3: exactly once (G1),\ndeterminism (G2), durability (G3)", stated) == []
    assert unnamed_guarantees("G1–G2: exactly once (G1), determinism (G2)", stated) == [
        "the range G1–G3", "durability (G3)"]


def ha_figures(results: str) -> list[str]:
    """The figures the README's HA row quotes from benchmarks/results/ha.md: 3 replicas' grants/s with progress
    moved and on the read path, one SQLite coordinator's, the threaded serving's, and their ratios."""
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in results.splitlines()]
    moved, read = [r for r in cells if r[:2] and r[0] == "grants/s" and r[1].startswith("64 ranks")][:2]  # this tree's
    out = []
    for row in (moved, read):  # (measure, load, SQLite, PostgreSQL 1, 2, 3 replicas): "2,014/s (0.94x)"
        out += [row[5].split(" ")[0], row[2].removesuffix("/s"), row[5].split("(")[1].rstrip(")")]
    for row in (r for r in cells if r[:1] == ["PostgreSQL, 3 replicas"]):  # (what, load, old, new, new / old, target)
        out += [row[2].removesuffix("/s"), row[4]]
    return out


def test_the_readmes_ha_row_is_what_the_results_say() -> None:
    row = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if "benchmarks/results/ha.md" in ln)
    figures = ha_figures((ROOT / "benchmarks" / "results" / "ha.md").read_text())
    assert len(figures) == 10
    assert [f for f in figures if f not in row] == [], row
