"""--speculative-config on the command line, and vLLM's spec_decode metrics on /metrics."""

import json

import aiohttp
from test_server_support import parse_metrics, serving

from asyncllm import AsyncLLM, SamplingParams
from asyncllm.config import SpeculativeConfig
from asyncllm.serve import engine_args_from, make_parser

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_the_cli_takes_vllms_json():
    namespace = make_parser().parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert SpeculativeConfig.parse(engine_args_from(namespace).speculative_config) == (
        SpeculativeConfig("ngram", 3)
    )


async def test_metrics_report_drafts_and_accepted_tokens(tiny_model_dir):
    engine = AsyncLLM.from_engine_args(
        model=str(tiny_model_dir), max_model_len=256, speculative_config=NGRAM
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8] * 8}
    async for _ in engine.generate(prompt, params, "r"):
        pass
    async with (
        serving(engine) as (url, _),
        aiohttp.ClientSession() as session,
        session.get(f"{url}/metrics") as response,
    ):
        text = await response.text()
    await engine.shutdown()
    metrics = parse_metrics(text)
    drafts = metrics["asyncllm:spec_decode_num_drafts_total"]
    draft_tokens = metrics["asyncllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["asyncllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < drafts <= draft_tokens <= 3 * drafts
    assert 0 <= accepted <= draft_tokens
    assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text
    assert 'position="0"' in text
