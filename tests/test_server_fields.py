"""The table of request fields: it agrees with SamplingParams' own validation, covers every
setting a request can make, and is what /openapi.json describes."""

from __future__ import annotations

import dataclasses

import pytest

from asyncllm.errors import ValidationError
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.fields import CHAT, COMPLETIONS, DETOKENIZE, FIELDS, TOKENIZE, Field
from asyncllm.server.openapi import openapi_spec
from asyncllm.server.protocol import ProtocolError, checked_fields

RANGED = [f for f in FIELDS if f.has_range]
VALID = {
    COMPLETIONS: {"prompt": "x"},
    CHAT: {"messages": [{"role": "user", "content": "x"}]},
    DETOKENIZE: {"tokens": [1]},
}


def _wrapped(f: Field, number: float):
    """The number as the field carries it: alone, in an array, or as an object's value."""
    if f.items is None:
        return number
    return {"7": number} if "object" in f.types else [number]


def _accepted(f: Field, number: float) -> bool:
    """By SamplingParams for the fields it takes, by the parser for the server's own."""
    value = _wrapped(f, int(number) if "integer" in (f.items, *f.types) else number)
    try:
        if f.param is not None:
            SamplingParams(**{"max_tokens": None, f.param: value})
        else:
            route = f.routes[0]
            checked_fields({**VALID.get(route, {}), f.name: value}, route)
    except (ValidationError, ProtocolError):
        return False
    return True


def _step(f: Field) -> float:
    return 1 if "integer" in (f.items, *f.types) else 1e-6


@pytest.mark.parametrize("f", RANGED, ids=lambda f: f"{f.routes[0]}.{f.name}")
def test_each_range_in_the_table_is_the_one_enforced(f: Field) -> None:
    step = _step(f)
    if f.minimum is not None:
        assert _accepted(f, f.minimum) != f.exclusive_minimum
        assert _accepted(f, f.minimum + step)
        assert not _accepted(f, f.minimum - step)
    if f.maximum is not None:
        assert _accepted(f, f.maximum)
        assert not _accepted(f, f.maximum + step)
    else:
        assert _accepted(f, 10**6)


def test_the_table_sets_every_sampling_field_a_request_may_set() -> None:
    settable = {f.name for f in dataclasses.fields(SamplingParams)} - {"output_kind"}
    assert {f.param for f in FIELDS if f.param is not None} == settable


@pytest.mark.parametrize(
    ("route", "schema"),
    [
        (COMPLETIONS, "CompletionRequest"),
        (CHAT, "ChatCompletionRequest"),
        (TOKENIZE, "TokenizeRequest"),
        (DETOKENIZE, "DetokenizeRequest"),
    ],
)
def test_openapi_describes_the_fields_of_each_route(route: str, schema: str) -> None:
    body = openapi_spec()["components"]["schemas"][schema]
    names = {f.name for f in FIELDS if route in f.routes}
    assert set(body["properties"]) == names
    required = {f.name for f in FIELDS if route in f.routes and f.required}
    assert set(body.get("required", [])) == required


def test_openapi_states_exclusive_minimums_as_openapi_3_0_does() -> None:
    properties = openapi_spec()["components"]["schemas"]["CompletionRequest"]["properties"]
    top_p = properties["top_p"]
    assert (top_p["minimum"], top_p["exclusiveMinimum"], top_p["maximum"]) == (0, True, 1)


def test_wrong_types_name_the_field_and_its_type() -> None:
    with pytest.raises(ProtocolError) as error:
        checked_fields({"prompt": "x", "stop_token_ids": [1, "2"]}, COMPLETIONS)
    assert error.value.param == "stop_token_ids"
    assert error.value.message == "stop_token_ids must be an array of integers."
    with pytest.raises(ProtocolError) as nested:
        checked_fields({"prompt": "x", "stream_options": {"include_usage": 1}}, COMPLETIONS)
    assert nested.value.param == "stream_options.include_usage"
