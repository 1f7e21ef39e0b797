"""bench/cli_start.py: every command it times runs to its end against a private Redis, and a
row is printed for each."""

from __future__ import annotations

import pytest

from bench import cli_start


def test_cli_start_times_every_command_to_its_end(capsys: pytest.CaptureFixture[str]) -> None:
    cli_start.main(["--rounds", "1", "--keys", "300"])  # a command that fails raises, naming it
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["command", "this", "p50", "s"]
    assert out[-1].startswith("rag keys list (this, first run): ")
    assert out[-1].endswith(" s, among 300 other keys")
    rows = {line[:24].strip(): line[24:].split() for line in out[1:-1]}
    assert set(rows) == set(cli_start.COMMANDS)
    assert all(float(this) > 0 for (this,) in rows.values())
