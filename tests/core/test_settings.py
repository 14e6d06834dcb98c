"""The CROUPIER_* variables: read in one module only, and listed in docs/settings.md exactly as that module has them."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from croupier.core import settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("core", "server", "client", "tools", "integrations")


def reads_outside(root: pathlib.Path = ROOT) -> list[str]:
    """Every read of a CROUPIER_* variable outside core/settings.py: ``X.get("CROUPIER_...")``,
    ``os.getenv("CROUPIER_...")`` or ``X["CROUPIER_..."]`` read (writes into an environment are fine)."""
    bad = []
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == "core/settings.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                key = None
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("get", "getenv") and node.args
                        and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "settings")):
                    key = node.args[0]
                elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                    key = node.slice
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("CROUPIER_"):
                    bad.append(f"{rel}:{node.lineno}: reads {key.value}")
    return bad


def test_every_variable_is_read_through_the_settings_module() -> None:
    assert reads_outside() == []


def test_the_read_check_can_fail(tmp_path: pathlib.Path) -> None:
    for folder in SOURCES:
        (tmp_path / folder).mkdir()
    (tmp_path / "client" / "x.py").write_text(
        "import os\nA = os.environ.get('CROUPIER_JOB')\nB = os.environ['CROUPIER_TOKEN']\nos.environ['CROUPIER_X'] = '1'\n")
    assert reads_outside(tmp_path) == ["client/x.py:2: reads CROUPIER_JOB", "client/x.py:3: reads CROUPIER_TOKEN"]


def test_the_docs_table_is_the_settings_table() -> None:
    text = (ROOT / "docs" / "settings.md").read_text()
    rows = re.findall(r"^\| `(CROUPIER_[A-Z_]+)` \| (.*?) \| (.*) \|$", text, flags=re.M)
    assert [r[0] for r in rows] == list(settings.SETTINGS), "docs/settings.md lists other variables than croupier.core.settings"
    for name, default, meaning in rows:
        s = settings.SETTINGS[name]
        assert default == (f"`{s.default}`" if s.default else "(unset)") and meaning == s.meaning, name


def test_every_name_the_code_mentions_is_in_the_table() -> None:
    """A CROUPIER_* name written anywhere in the code (set for a subprocess, or named in a message) is a known one."""
    named = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            named |= set(re.findall(r"\bCROUPIER_[A-Z_]*[A-Z]\b", path.read_text()))
    assert named - set(settings.SETTINGS) == set()


def test_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CROUPIER_JOB", "")
    assert settings.get("CROUPIER_JOB") is None, "empty is unset"
    monkeypatch.delenv("CROUPIER_STORE", raising=False)
    assert settings.get("CROUPIER_STORE") == "sqlite:///croupier.db"
    monkeypatch.setenv("CROUPIER_JOIN_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"CROUPIER_JOIN_TIMEOUT must be a number \(got CROUPIER_JOIN_TIMEOUT='soon'\)"):
        settings.get_float("CROUPIER_JOIN_TIMEOUT")
    monkeypatch.setenv("CROUPIER_TLS", "Yes")
    assert settings.flag("CROUPIER_TLS")
    with pytest.raises(KeyError):
        settings.get("CROUPIER_NOT_A_SETTING")


def test_the_incarnation_is_read_under_its_old_name_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CROUPIER_INCARNATION", raising=False)
    monkeypatch.setenv("CROUPIER_TOKEN", "run-3")
    assert settings.get("CROUPIER_INCARNATION") == "run-3", "the old name is read when the new one is unset"
    monkeypatch.setenv("CROUPIER_INCARNATION", "")
    assert settings.get("CROUPIER_INCARNATION") == "run-3", "empty is unset"
    monkeypatch.setenv("CROUPIER_INCARNATION", "run-4")
    assert settings.get("CROUPIER_INCARNATION") == "run-4", "the new name wins"
