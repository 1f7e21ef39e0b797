"""The `rag` command run as a user runs it: `python -m app.cli ...` in a child process."""

from __future__ import annotations

import os
import subprocess
import sys


def rag(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run `rag ARGS` with this environment plus `env`; its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
