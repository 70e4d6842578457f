"""Start-up as a user meets it: a busy port is one clear line and a failing exit before any
model loads."""

from __future__ import annotations

import socket
import subprocess
import sys


def test_busy_port_is_one_line_and_exit_1_before_the_model_loads(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        missing = tmp_path / "never-loaded"  # loading it would fail with another message
        command = [sys.executable, "-m", "asyncllm.serve", "--model", str(missing)]
        result = subprocess.run(
            [*command, "--port", str(port)], capture_output=True, text=True, timeout=120
        )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (
        f"asyncllm: cannot listen on 127.0.0.1:{port}: Address already in use (--port picks another)"
    )
    assert "Traceback" not in result.stderr and "loading the model" not in result.stderr
