"""Request parsing: OpenAI bodies -> prompts and SamplingParams, or an OpenAI error."""

from __future__ import annotations

import pytest

from asyncllm.errors import ValidationError
from asyncllm.sampling_params import RequestOutputKind
from asyncllm.server import protocol
from asyncllm.server.protocol import ProtocolError, parse_chat, parse_completion


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [{"prompt_token_ids": [1, 2, 3]}]),
        ([[1], [2, 3]], [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]),
    ],
)
def test_completion_prompt_forms(prompt, expected) -> None:
    assert parse_completion({"prompt": prompt}).prompts == expected


@pytest.mark.parametrize("prompt", [None, [], 5, [1, "a"], [[]], [True, 2], {"a": 1}])
def test_bad_prompts_are_400(prompt) -> None:
    with pytest.raises(ProtocolError) as error:
        parse_completion({"prompt": prompt})
    assert error.value.status == 400 and error.value.param == "prompt"


def test_completion_defaults_follow_openai() -> None:
    req = parse_completion({"prompt": "x"})
    assert req.params.max_tokens == 16 and req.params.temperature == 1.0
    assert not req.stream and req.params.output_kind == RequestOutputKind.FINAL_ONLY
    assert req.add_special_tokens


def test_streams_ask_the_engine_for_deltas() -> None:
    req = parse_completion(
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    )
    assert req.params.output_kind == RequestOutputKind.DELTA and req.include_usage


def test_stream_options_need_stream() -> None:
    with pytest.raises(ProtocolError) as error:
        parse_completion({"prompt": "x", "stream_options": {"include_usage": True}})
    assert (error.value.status, error.value.param) == (400, "stream_options")


def test_sampling_fields_map_to_vllm_names() -> None:
    req = parse_completion(
        {
            "prompt": "x",
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 7,
            "min_p": 0.1,
            "seed": 3,
            "stop": "END",
            "ignore_eos": True,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "logprobs": 2,
            "logit_bias": {"42": 5},
        }
    )
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.0, 0.5, 7, 0.1, 3)
    assert p.stop == ["END"] and p.ignore_eos and p.logprobs == 2 and req.logprobs == 2
    for name, value in (("presence_penalty", 0.5), ("frequency_penalty", 0.25)):
        assert getattr(p, name, value) == value
    assert getattr(p, "logit_bias", {42: 5.0}) == {42: 5.0}


def test_chat_fields() -> None:
    req = parse_chat(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 9,
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 4,
            "priority": -1,
        }
    )
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert req.params.max_tokens == 9 and req.params.logprobs == 4 and req.priority == -1
    assert not req.add_special_tokens  # the chat template holds them


def test_chat_max_tokens_defaults_to_the_context() -> None:
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}]}).params.max_tokens is None


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"prompt": "x", "max_tokens": True}, "invalid_type", "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "invalid_type", "temperature"),
        ({"prompt": "x", "stop": [1]}, "invalid_type", "stop"),
        ({"prompt": "x", "stream": "yes"}, "invalid_type", "stream"),
        ({"max_tokens": 3}, "missing_required_parameter", "prompt"),
        ({"prompt": "x", "temperature": -0.5}, None, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, None, "max_tokens"),
        ({"prompt": "x", "n": 0}, None, "n"),
    ],
)
def test_wrong_types_and_bad_values_are_400_naming_the_field(body, code, param) -> None:
    with pytest.raises(ProtocolError) as error:
        parse_completion(body)
    assert (error.value.status, error.value.code, error.value.param) == (400, code, param)
    assert set(error.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": []},
        {"messages": ["hi"]},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": 5}]},
    ],
)
def test_bad_messages_are_refused(body) -> None:
    with pytest.raises(ProtocolError) as error:
        parse_chat(body)
    assert error.value.status == 400


def test_top_logprobs_without_logprobs_is_400() -> None:
    with pytest.raises(ProtocolError) as error:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert (error.value.status, error.value.param) == (400, "top_logprobs")


def test_unknown_fields_are_ignored() -> None:
    req = parse_completion({"prompt": "x", "user": "u", "suffix": None, "whatever": [1]})
    assert req.prompts == ["x"]


def test_context_length_errors_carry_openais_code() -> None:
    error = protocol.from_validation_error(
        ValidationError(
            "prompt is 600 tokens long; the maximum model length is 512, ...",
            code="context_length_exceeded",
        )
    )
    assert (error.status, error.code) == (400, "context_length_exceeded")


def test_engine_validation_errors_carry_their_param() -> None:
    error = protocol.from_validation_error(ValidationError("no room.", param="logprobs"))
    assert (error.status, error.param, error.message) == (400, "logprobs", "no room.")


def test_malformed_json_is_400() -> None:
    with pytest.raises(ProtocolError) as error:
        protocol.decode_json_body(b"{nope")
    assert error.value.status == 400


def test_serve_flags_cover_engine_args_and_server_args() -> None:
    from asyncllm.serve import engine_args_from, make_parser

    namespace = make_parser().parse_args(
        ["--model", "m", "--max-num-seqs", "4", "--no-enable-prefix-caching", "--port", "0",
         "--long-prefill-token-threshold", "256"]
    )  # fmt: skip
    engine_args = engine_args_from(namespace)
    assert (engine_args.model, engine_args.max_num_seqs) == ("m", 4)
    assert engine_args.long_prefill_token_threshold == 256
    assert not engine_args.enable_prefix_caching and engine_args.max_model_len is None
    assert (namespace.host, namespace.port) == ("127.0.0.1", 0)


def test_cli_serve_is_the_same_parser(capsys) -> None:
    from asyncllm import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0 and "--max-concurrent-requests" in capsys.readouterr().out
