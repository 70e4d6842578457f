"""bench/soak.py in its short form (under half a minute of load on the tiny model): every request
ends (completed, dropped or cancelled, none lost, none left running), the KV cache is empty at
each idle point, and the result names the machine. The 30-minute figure is the lead's to run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.append(
    str(Path(__file__).resolve().parents[1] / "bench")
)  # after the project root: bench/kernels.py must not shadow kernels
import soak  # noqa: E402 (bench/soak.py, found through the path above)


def test_a_short_soak_loses_nothing_and_leaves_the_cache_empty(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "soak.json"
    server = ["--model", str(tiny_model_dir), "--max-model-len", "512", "--num-kv-blocks", "2048"]
    flags = ["--minutes", "0.4", "--interval-s", "8", "--settle-minutes", "0", "--burst", "16"]
    soak.main([*flags, "--out", str(out), "--log", str(tmp_path / "server.log"), "--", *server])
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert len(result["records"]) >= 3
    assert summary["lost"] == 0 and summary["left_running"] == 0
    assert summary["max_kv_usage_idle"] == 0
    assert set(summary["ends"]) <= {"completed", "dropped", "cancelled"}, summary["ends"]
    assert summary["ends"]["completed"] > 0 and summary["sent"] == sum(summary["ends"].values())
    assert result["server_exit_code"] == 0
    assert result["cpu"] and "vector_extensions" in result
    record = result["records"][-1]
    assert record["rss_mib"] > 0 and record["fds"] > 0 and record["threads"] > 0
    assert record["longest_health_ms"] > 0
