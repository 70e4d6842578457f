"""A StructuredOutputsParams in xgrammar's terms: checked without the vocabulary (the front end
refuses a bad schema, regex or grammar with a 400 naming the field), and compiled against it."""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from asyncllm.errors import ValidationError
from asyncllm.sampling_params import StructuredOutputsParams

# compact JSON: a free-whitespace grammar lets a small model pad the output with newlines until
# it runs out of tokens
_JSON_OPTIONS = {"any_whitespace": False}
_ANY_OBJECT = '{"type": "object"}'


def schema_text(schema: str | dict) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose root is one of the strings, each as a JSON-escaped literal."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_source(params: StructuredOutputsParams) -> tuple[str, str]:
    """(language, text): the constraint as a JSON schema, a regex or EBNF."""
    if params.json is not None:
        return "json_schema", schema_text(params.json)
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "ebnf", choice_grammar(params.choice)
    if params.grammar is not None:
        return "ebnf", params.grammar
    return "json_schema", _ANY_OBJECT


def check_structured_outputs(params: StructuredOutputsParams, param: str | None = None) -> None:
    """Raises ValidationError naming `param` (default structured_outputs.<kind>) when xgrammar
    cannot read the constraint."""
    language, text = grammar_source(params)
    readers = {
        "json_schema": xgr.Grammar.from_json_schema,
        "regex": xgr.Grammar.from_regex,
        "ebnf": xgr.Grammar.from_ebnf,
    }
    try:
        readers[language](text, **_options(language))
    except (RuntimeError, ValueError, TypeError) as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        param = param or f"structured_outputs.{params.kind}"
        raise ValidationError(f"{param} is invalid: {lines[-1]}", param) from e


def compile_structured_outputs(
    compiler: xgr.GrammarCompiler, params: StructuredOutputsParams
) -> xgr.CompiledGrammar:
    """Through the compiler's cache, which is keyed by the text: a schema compiles once."""
    language, text = grammar_source(params)
    compilers = {
        "json_schema": compiler.compile_json_schema,
        "regex": compiler.compile_regex,
        "ebnf": compiler.compile_grammar,
    }
    return compilers[language](text, **_options(language))


def _options(language: str) -> dict[str, Any]:
    return _JSON_OPTIONS if language == "json_schema" else {}
