"""`croupier serve`'s flags: its defaults are ServerOptions' own, and bad values are refused by name."""

from __future__ import annotations

import dataclasses
import re

import pytest

from croupier.server import ServerOptions
from croupier.tools.cli import build_parser, main


def test_every_server_option_is_a_flag_whose_default_is_the_options_default() -> None:
    args = build_parser().parse_args(["serve"])
    for field in dataclasses.fields(ServerOptions):
        assert getattr(args, field.name) == field.default, f"--{field.name.replace('_', '-')}"
    assert ServerOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions)}) == ServerOptions()


def test_the_help_shows_the_options_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    defaults = ServerOptions()
    for name in ("max_jobs", "max_world", "max_request_bytes", "max_concurrent_joins", "snapshot_every",
                 "max_staleness_ms"):
        assert f"(default {getattr(defaults, name)}" in text, name


@pytest.mark.parametrize("flags, why", [
    (["--max-staleness-ms", "60001"], r"max_staleness_ms must be in \[0, 60001\) \(got max_staleness_ms=60001\)"),
    (["--log-format", "xml"], r"log_format must be one of \['text', 'json'\] \(got log_format='xml'\)"),
    (["--max-world", "0"], r"max_world must be in \[1, 1048577\) \(got max_world=0\)"),
])
def test_a_bad_flag_is_refused_by_name(flags: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--store", "memory://", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("croupier serve: error: ")
    assert re.search(why, err), err
