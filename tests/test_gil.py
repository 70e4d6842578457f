"""With the model on a GPU the engine shortens the GIL's switch interval in its processes
(asyncllm/engine/gil.py says why; bench/gil_handoff.py measures it), never lengthening one set
shorter; on CPU it leaves it as it is."""

import sys

import pytest
import torch

from asyncllm import LLM
from asyncllm.engine.gil import SWITCH_INTERVAL_S, shorten_switch_interval


@pytest.fixture
def default_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # CPython's default
    yield
    sys.setswitchinterval(before)


def test_a_longer_interval_is_shortened_and_a_shorter_one_kept(default_interval) -> None:
    shorten_switch_interval(torch.device("cuda"))
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    sys.setswitchinterval(SWITCH_INTERVAL_S / 5)
    shorten_switch_interval(torch.device("cuda"))
    assert sys.getswitchinterval() == pytest.approx(
        SWITCH_INTERVAL_S / 5, abs=2e-6
    )  # held in whole us


def test_an_engine_on_cpu_leaves_it(default_interval, tiny_model_dir) -> None:
    LLM(model=str(tiny_model_dir), max_model_len=128, num_kv_blocks=64, device="cpu")
    assert sys.getswitchinterval() == pytest.approx(0.005)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_engine_on_the_gpu_shortens_it(default_interval, tiny_model_dir) -> None:
    LLM(model=str(tiny_model_dir), max_model_len=128, num_kv_blocks=64)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
