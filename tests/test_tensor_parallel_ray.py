"""The Ray executor on a local cluster of two nodes, one rank on each: the same greedy ids as
the worker processes, and nothing left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tensor_parallel import greedy_engine, save_random_model

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_node_cluster(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the nodes' workers import this tree
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_ray_ranks_on_two_nodes_give_the_ids_of_worker_processes(
    two_node_cluster, tmp_path
) -> None:
    path = save_random_model("llama", tmp_path)
    ids, llm = greedy_engine(path, tensor_parallel_size=2, distributed_executor_backend="ray")
    executor = llm.core_client.core.executor
    workers = executor.workers
    assert len({ray.get(w.node_id.remote()) for w in workers}) == 2
    llm.core_client.shutdown()
    for worker in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.node_id.remote(), timeout=30)
    states = {g["state"] for g in ray.util.placement_group_table().values()}
    assert states == {"REMOVED"}
    ray.shutdown()
    two_node_cluster.shutdown()
    expected, llm = greedy_engine(path, tensor_parallel_size=2)
    llm.core_client.shutdown()
    assert ids == expected
