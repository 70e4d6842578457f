"""Sampling defaults from the model's generation_config.json (--generation-config auto | vllm |
PATH, --override-generation-config): they fill the fields a request leaves out, in the server and
in LLM.generate / chat, and never a field the request sets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from test_server_support import serving

from asyncllm import LLM, AsyncLLM, EngineArgs, SamplingParams
from asyncllm.model_files.generation_config import sampling_defaults

SETTINGS = {
    "do_sample": True,
    "temperature": 0.0,
    "top_k": 5,
    "max_new_tokens": 3,
    "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def model_with_settings(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a generation_config.json that asks for greedy 3-token replies."""
    path = tmp_path_factory.mktemp("with-settings") / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "generation_config.json").write_text(json.dumps(SETTINGS))
    return path


def test_auto_reads_the_models_sampling_fields(model_with_settings) -> None:
    assert sampling_defaults(model_with_settings) == {
        "temperature": 0.0,
        "top_k": 5,
        "max_tokens": 3,
    }


def test_vllm_ignores_the_model_but_not_the_overrides(model_with_settings) -> None:
    assert sampling_defaults(model_with_settings, "vllm") == {}
    assert sampling_defaults(model_with_settings, "vllm", '{"top_p": 0.5}') == {"top_p": 0.5}


def test_a_path_of_its_own_and_overrides_on_top(model_with_settings, tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.7, "top_p": 0.8}')
    overrides = {"temperature": 0.1}
    expected = {"temperature": 0.1, "top_p": 0.8}
    assert sampling_defaults(model_with_settings, str(tmp_path), overrides) == expected


def test_unknown_override_is_refused(model_with_settings) -> None:
    with pytest.raises(ValueError, match="unknown key.*max_tokens"):
        sampling_defaults(model_with_settings, "auto", '{"max_tokens": 3}')
    with pytest.raises(ValueError, match="not valid JSON"):
        sampling_defaults(model_with_settings, "auto", "{temperature")


def test_llm_generate_and_chat_use_the_defaults(model_with_settings) -> None:
    llm = LLM(model=str(model_with_settings), max_model_len=512, num_kv_blocks=256)
    assert llm.get_default_sampling_params().max_tokens == 3
    generated = llm.generate(["Once upon a"], use_tqdm=False)[0].outputs[0]
    assert len(generated.token_ids) <= 3
    chat = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0].outputs[0]
    assert len(chat.token_ids) <= 3
    given = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert len(llm.generate(["Once upon a"], given, use_tqdm=False)[0].outputs[0].token_ids) == 6


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_with_settings):
    args = EngineArgs(model=str(model_with_settings), max_model_len=512, num_kv_blocks=256)
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    await engine.shutdown()


async def completion_tokens(url: str, route: str, body: dict) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/{route}", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        return (await response.json())["usage"]["completion_tokens"]


@pytest.mark.asyncio(loop_scope="module")
async def test_server_fills_only_the_fields_left_out(engine) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    prompt = {"prompt": "Once upon a", "ignore_eos": True}
    async with serving(engine) as (url, _):
        assert await completion_tokens(url, "chat/completions", chat) == 3
        assert await completion_tokens(url, "completions", prompt) == 3  # min(16, the model's)
        assert await completion_tokens(url, "chat/completions", {**chat, "max_tokens": 5}) == 5
        assert await completion_tokens(url, "completions", {**prompt, "max_tokens": 7}) == 7


@pytest.mark.asyncio(loop_scope="module")
async def test_defaults_greedy_unless_the_request_samples(engine) -> None:
    body = {"prompt": "Once upon a", "ignore_eos": True, "max_tokens": 6, "n": 4}
    async with serving(engine) as (url, _), aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            greedy = {c["text"] for c in (await response.json())["choices"]}
        hot = {**body, "temperature": 2.0, "top_k": -1}
        async with session.post(f"{url}/v1/completions", json=hot) as response:
            sampled = {c["text"] for c in (await response.json())["choices"]}
    assert len(greedy) == 1  # temperature 0 from the model: four equal choices
    assert len(sampled) > 1
