"""The request fields that constrain a sample's output (structured outputs), as OpenAI and vLLM
write them; both request models inherit `StructuredFields`. Only their form is checked here:
services/router/api/structured.py turns them into the one constraint a request may carry.

- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`, and
  vLLM's `{"type": "structural_tag", ...}`.
- vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object,
  structural_tag, with JSON's whitespace options.
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, with
  `guided_whitespace_pattern` (JSON's whitespace) and `guided_decoding_backend`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

Backend = Literal["auto", "xgrammar", "guidance"]
JsonValue = dict[str, Any]  # a JSON schema or structural tag, as the client wrote it


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$",
                                     description="a-z, A-Z, 0-9, _ and -, at most 64 characters")]
    description: StrictStr | None = None
    # Optional in OpenAI's schema; without it there is nothing to constrain: a 400, as vLLM's.
    schema_: JsonValue | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # the output always follows the schema strictly


class LegacyStructuralTag(BaseModel):
    """One structure of vLLM's older structural-tag response_format."""

    model_config = ConfigDict(extra="forbid")

    begin: StrictStr
    schema_: JsonValue | None = Field(default=None, alias="schema")
    end: StrictStr


class ResponseFormat(BaseModel):
    """`json_schema` goes with type json_schema; `structures` and `triggers` (vLLM's older form)
    or `format` (xgrammar's) with type structural_tag."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[LegacyStructuralTag] | None = None
    triggers: list[StrictStr] | None = None
    format: JsonValue | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams' request fields)."""

    model_config = ConfigDict(extra="forbid")

    json_: JsonValue | StrictStr | None = Field(default=None, alias="json")  # a schema, or its JSON text
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None  # EBNF (GBNF) or Lark
    json_object: StrictBool | None = None
    structural_tag: JsonValue | StrictStr | None = None
    disable_any_whitespace: StrictBool = False
    whitespace_pattern: StrictStr | None = None
    disable_additional_properties: Literal[False] = Field(
        default=False, description="not supported: an object's extra properties follow its schema")


class StructuredFields(BaseModel):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: JsonValue | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None
    # The backend for this request's constraint (default: the router's --structured-outputs-backend).
    guided_decoding_backend: Backend | None = None
