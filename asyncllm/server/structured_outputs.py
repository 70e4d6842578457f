"""OpenAI's response_format as a structured-outputs constraint, and the check that names the
request field a bad schema came from."""

from __future__ import annotations

from typing import Any

from asyncllm.errors import ValidationError
from asyncllm.sampling_params import SamplingParams, StructuredOutputsParams

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_SCHEMA_PARAM = "response_format.json_schema.schema"


def from_response_format(
    response_format: dict[str, Any], structured_outputs: Any
) -> StructuredOutputsParams | None:
    """None for type text; json_object: any object; json_schema: its schema (strict or not,
    the output is held to it)."""
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValidationError(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}.",
            "response_format.type",
        )
    if kind == "text":
        return structured_outputs
    if structured_outputs is not None:
        raise ValidationError(
            "give response_format or structured_outputs, not both.", "structured_outputs"
        )
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict):
        raise ValidationError(
            "response_format.json_schema must be an object.", "response_format.json_schema"
        )
    schema = json_schema.get("schema")
    if not isinstance(schema, dict):
        raise ValidationError(f"{_SCHEMA_PARAM} must be a JSON schema object.", _SCHEMA_PARAM)
    return StructuredOutputsParams(json=schema)


def check_constraint(params: SamplingParams, from_response_format: bool) -> None:
    """Refuses a constraint xgrammar cannot read, naming the field it came from."""
    if params.structured_outputs is not None:
        from asyncllm.structured_output.grammar import check_structured_outputs

        param = _SCHEMA_PARAM if from_response_format else None
        check_structured_outputs(params.structured_outputs, param)
