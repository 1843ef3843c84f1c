"""A request's structured-output fields (structured_fields.py) as the one constraint its samples
carry, checked and given its backend before any worker sees the request:

    constraint = requested(body)                       # None, or a 400 naming the field
    params = choices.choose(constraint.params, constraint.backend or config_backend)

`StructuredOutputsParams.source` is the API field the constraint came from
("response_format.json_schema.schema", "structured_outputs.regex", "guided_choice", ...): the
engine's checks (engine/structured/select.py) name it, and so does the 400.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from engine.structured.params import KINDS, StructuredOutputsParams
from engine.structured.select import choose_backend
from services.router.api.structured_fields import StructuredFields
from services.router.errors import OpenAIError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_JSON_KINDS = ("json", "json_object")


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams  # backend not chosen yet
    backend: str | None  # the request's preference (guided_decoding_backend), if any


def requested(body: StructuredFields) -> Constraint | None:
    """The request's one constraint, or None; an OpenAIError 400 naming the field when two forms
    are used at once or one is malformed."""
    forms = _forms(body)
    if len(forms) > 1:
        raise OpenAIError(400, f"{forms[1]}: cannot be used with {forms[0]} (a request's output takes "
                               f"one structured-output constraint)", forms[1])
    pattern = body.guided_whitespace_pattern
    if not forms:
        if pattern is not None:
            raise OpenAIError(400, "guided_whitespace_pattern: sets JSON's whitespace, but the request "
                                   "asks for no JSON output", "guided_whitespace_pattern")
        return None
    params = _params(body, forms[0])
    if pattern is not None:
        if forms[0] == "structured_outputs":
            raise OpenAIError(400, "guided_whitespace_pattern: use structured_outputs.whitespace_pattern "
                                   "with structured_outputs", "guided_whitespace_pattern")
        if params.kind not in _JSON_KINDS:
            raise OpenAIError(400, f"guided_whitespace_pattern: sets JSON's whitespace; {forms[0]} is "
                                   f"not JSON", "guided_whitespace_pattern")
        params = replace(params, whitespace_pattern=pattern)
    return Constraint(params, body.guided_decoding_backend)


def _forms(body: StructuredFields) -> list[str]:
    """The request's fields that each ask for a constraint, in a fixed order."""
    forms = []
    if body.response_format is not None and body.response_format.type != "text":
        forms.append("response_format")
    if body.structured_outputs is not None:
        forms.append("structured_outputs")
    forms += [f for f in _GUIDED if getattr(body, f) is not None]
    return forms


def _params(body: StructuredFields, form: str) -> StructuredOutputsParams:
    try:
        if form == "response_format":
            return _response_format(body)
        if form == "structured_outputs":
            return _structured_outputs(body)
        return StructuredOutputsParams(**{_GUIDED[form]: getattr(body, form)}, source=form)
    except ValueError as e:  # StructuredOutputsParams' own checks
        raise OpenAIError(400, str(e), form) from e


def _response_format(body: StructuredFields) -> StructuredOutputsParams:
    fmt = body.response_format
    assert fmt is not None
    extras = [f for f in ("json_schema", "structures", "triggers", "format")
              if getattr(fmt, f) is not None and not _belongs(f, fmt.type)]
    if extras:
        raise OpenAIError(400, f"response_format.{extras[0]}: does not go with type {fmt.type!r}",
                          f"response_format.{extras[0]}")
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, source="response_format")
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise OpenAIError(400, "response_format.json_schema: required with type 'json_schema'",
                              "response_format.json_schema")
        if fmt.json_schema.schema_ is None:
            raise OpenAIError(400, "response_format.json_schema.schema: required (the schema the output "
                                   "follows)", "response_format.json_schema.schema")
        return StructuredOutputsParams(json=json.dumps(fmt.json_schema.schema_),
                                       source="response_format.json_schema.schema")
    return StructuredOutputsParams(structural_tag=json.dumps(_structural_tag(body)), source="response_format")


def _belongs(field: str, type_: str) -> bool:
    return {"json_schema": "json_schema"}.get(field, "structural_tag") == type_


def _structural_tag(body: StructuredFields) -> dict[str, Any]:
    """vLLM's structural-tag response_format: its older form (structures and triggers) or
    xgrammar's (format), as the JSON the engine compiles."""
    fmt = body.response_format
    assert fmt is not None
    if fmt.format is not None:
        if fmt.structures is not None or fmt.triggers is not None:
            raise OpenAIError(400, "response_format.format: goes without structures and triggers",
                              "response_format.format")
        return {"type": "structural_tag", "format": fmt.format}
    if fmt.structures is None or fmt.triggers is None:
        raise OpenAIError(400, "response_format.structures: a structural tag needs structures and "
                               "triggers (or format)", "response_format.structures")
    structures = [{"begin": s.begin, "schema": s.schema_ or {}, "end": s.end} for s in fmt.structures]
    return {"structures": structures, "triggers": fmt.triggers}


def _structured_outputs(body: StructuredFields) -> StructuredOutputsParams:
    so = body.structured_outputs
    assert so is not None
    values: dict[str, Any] = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                              "grammar": so.grammar, "json_object": so.json_object or None,
                              "structural_tag": so.structural_tag}
    kinds = [k for k in KINDS if values[k] is not None]
    if not kinds:
        raise OpenAIError(400, f"structured_outputs: must set one of {', '.join(KINDS)}",
                          "structured_outputs")
    if len(kinds) > 1:
        raise OpenAIError(400, f"structured_outputs.{kinds[1]}: cannot be used with structured_outputs."
                               f"{kinds[0]} (structured_outputs sets one of {', '.join(KINDS)})",
                          f"structured_outputs.{kinds[1]}")
    kind = kinds[0]
    value = values[kind]
    if kind == "structural_tag" and not isinstance(value, str):
        value = json.dumps(value)
    for option in ("whitespace_pattern", "disable_any_whitespace"):
        if getattr(so, option) not in (None, False) and kind not in _JSON_KINDS:
            raise OpenAIError(400, f"structured_outputs.{option}: sets JSON's whitespace; the constraint "
                                   f"is {kind}", f"structured_outputs.{option}")
    return StructuredOutputsParams(**{kind: value}, disable_any_whitespace=so.disable_any_whitespace,
                                   whitespace_pattern=so.whitespace_pattern,
                                   source=f"structured_outputs.{kind}")


class BackendChoices:
    """`choose_backend` with its answers for the specs seen last kept: clients repeat their
    schemas, and checking a JSON schema against its metaschema alone costs ~2 ms. Failures are
    not kept. Thread-safe (long specs are checked in the tokenizer pool)."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._backends: OrderedDict[tuple[Any, ...], str] = OrderedDict()
        self._lock = threading.Lock()

    def choose(self, params: StructuredOutputsParams, preferred: str) -> StructuredOutputsParams:
        """`params` with its backend; an OpenAIError 400 naming params.source when no backend
        (of those `preferred` allows) compiles the spec."""
        key = (*params.key, preferred)
        with self._lock:
            backend = self._backends.get(key)
            if backend is not None:
                self._backends.move_to_end(key)
                return replace(params, backend=backend)
        try:
            chosen = choose_backend(params, preferred)
        except ValueError as e:
            raise OpenAIError(400, str(e), params.source) from e
        except RecursionError as e:  # JSON text nested past what json.loads parses
            raise OpenAIError(400, f"{params.source}: nested too deeply ({e})", params.source) from e
        assert chosen.backend is not None
        with self._lock:
            self._backends[key] = chosen.backend
            while len(self._backends) > self.size:
                self._backends.popitem(last=False)
        return chosen
