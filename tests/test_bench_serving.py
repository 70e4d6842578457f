"""bench/serving.py: the workload and arrival generators, and `asyncllm bench serve` run against a
real `python -m asyncllm.serve` on the tiny model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from test_server_support import ServerProcess, tiny_server_args

from asyncllm import cli

_SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "serving.py"
_spec = importlib.util.spec_from_file_location("bench_serving_under_test", _SCRIPT)
serving = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = serving
_spec.loader.exec_module(serving)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench-server") / "server.log"
    process = ServerProcess(log, *tiny_server_args(tiny_model_dir, "--served-model-name", "tiny"))
    yield process.start()
    process.stop()


def bench_serve(monkeypatch, server: ServerProcess, out: Path, *flags: str) -> dict:
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the dispatch rewrites sys.argv
    argv = ["bench", "serve", "--base-url", server.url, "--disable-tqdm", "--out", str(out)]
    cli.main([*argv, *flags])
    return json.loads(out.read_text())


def assert_sane(result: dict, num_prompts: int) -> None:
    assert result["completed"] == num_prompts and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == result["workload"]["output_tokens"]
    assert result["total_input_tokens"] == result["workload"]["prompt_tokens"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        ordered = [result[f"{stat}_{name}_ms"] for stat in ("median", "p90", "p99")]
        assert 0 < ordered[0] <= ordered[1] <= ordered[2], name
        assert result[f"mean_{name}_ms"] > 0
    for stat in ("mean", "median", "p90", "p99"):
        assert result[f"{stat}_ttft_ms"] <= result[f"{stat}_e2el_ms"]
    assert result["mean_e2el_ms"] <= result["duration_s"] * 1000
    expected = result["total_output_tokens"] / result["duration_s"]
    assert result["output_throughput"] == pytest.approx(expected)
    assert result["server"]["model"] == "tiny" and result["server"]["version"]
    assert result["server_cpu_s"] > 0 and result["server_cpu_us_per_chunk"] > 0


# -- generators ---------------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_average_the_rate() -> None:
    times = serving.arrival_times(4000, 20.0, seed=3)
    assert times == serving.arrival_times(4000, 20.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / (len(times) - 1) == pytest.approx(1 / 20.0, rel=0.1)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert serving.arrival_times(5, float("inf"), seed=0) == [0.0] * 5


@pytest.mark.parametrize("dataset", ["random", "sharegpt-like"])
def test_workload_lengths_and_ids_stay_in_bounds(dataset: str) -> None:
    workload = serving.make_workload(dataset, 500, 8, 300, vocab_size=1000, seed=1)
    assert workload == serving.make_workload(dataset, 500, 8, 300, vocab_size=1000, seed=1)
    for request in workload:
        assert 8 <= len(request.prompt) <= 300 and 8 <= request.output_len <= 300
        assert all(100 <= token < 1000 for token in request.prompt)


def test_sharegpt_like_lengths_have_a_long_right_tail() -> None:
    workload = serving.make_workload("sharegpt-like", 2000, 1, 4096, vocab_size=200, seed=0)
    prompts = [len(r.prompt) for r in workload]
    assert serving.percentile(prompts, 50) == pytest.approx(160, rel=0.15)
    assert sum(prompts) / len(prompts) > serving.percentile(prompts, 50)
    assert serving.percentile(prompts, 99) > 5 * serving.percentile(prompts, 50)


def test_percentile_interpolates_between_order_statistics() -> None:
    assert serving.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert serving.percentile([float(v) for v in range(101)], 99) == 99.0
    assert serving.percentile([7.0], 90) == 7.0


# -- against the real server --------------------------------------------------------------------


def test_fixed_rate_run_completes_every_request(server, monkeypatch, tmp_path) -> None:
    flags = ["--num-prompts", "8", "--min-len", "8", "--max-len", "24", "--request-rate", "16"]
    result = bench_serve(monkeypatch, server, tmp_path / "rate.json", *flags)
    assert_sane(result, 8)
    assert result["workload"]["request_rate"] == 16.0
    assert result["workload"]["max_concurrency"] is None


def test_fixed_concurrency_run_completes_every_request(server, monkeypatch, tmp_path) -> None:
    flags = ["--num-prompts", "8", "--dataset", "sharegpt-like", "--min-len", "4"]
    flags += ["--max-len", "48", "--max-concurrency", "2", "--metadata", "device=cpu"]
    result = bench_serve(monkeypatch, server, tmp_path / "concurrency.json", *flags)
    assert_sane(result, 8)
    assert result["workload"]["request_rate"] == "inf"
    assert result["workload"]["max_concurrency"] == 2
    assert result["metadata"] == {"device": "cpu"}


def test_refused_requests_count_as_failed(server, monkeypatch, tmp_path) -> None:
    flags = ["--num-prompts", "3", "--max-len", "40", "--model", "no-such-model"]
    with pytest.raises(SystemExit, match="every request failed"):
        bench_serve(monkeypatch, server, tmp_path / "refused.json", *flags, "--num-warmups", "0")
    result = json.loads((tmp_path / "refused.json").read_text())
    assert result["completed"] == 0 and result["failed"] == 3
    assert any("HTTP 404" in error for error in result["errors"])


@pytest.mark.parametrize(
    ("argv", "script"),
    [
        (["bench", "serve", "--help"], "serving.py"),
        (["bench", "throughput", "--help"], "throughput.py"),
        (["bench", "--help"], "throughput.py"),
    ],
)
def test_bench_dispatches_to_its_script(argv, script, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {script}")
