"""Checks a structured-outputs spec and picks the backend that compiles it (no tokenizer needed).

As vLLM's `auto`: xgrammar when it takes the spec (and the JSON schema uses nothing xgrammar
leaves unenforced), else llguidance; a spec neither takes is a ValueError naming the field. The
front ends (the engine's Processor, the router) call `choose_backend` before any engine sees the
request, so a bad schema, regex or grammar is a 400, never a failed step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.structured.params import StructuredOutputsParams
from engine.structured.xgrammar_gaps import unenforced

BACKENDS = ("auto", "xgrammar", "guidance")

_MAX_SPEC_CHARS = 256 * 1024


def choose_backend(params: StructuredOutputsParams, preferred: str = "auto") -> StructuredOutputsParams:
    """`params` with `backend` set to the one that compiles it; ValueError naming the field
    (params.source) when the spec is invalid or no backend (of those allowed) takes it."""
    if preferred not in BACKENDS:
        raise ValueError(f"structured outputs backend must be one of {BACKENDS}, got {preferred!r}")
    field = f"{params.source}"
    if len(params.spec) > _MAX_SPEC_CHARS:
        raise ValueError(f"{field}: the spec has {len(params.spec)} characters, more than "
                         f"{_MAX_SPEC_CHARS}")
    _check_form(params, field)
    order = ["xgrammar", "guidance"] if preferred == "auto" else [preferred]
    errors = []
    gap = unenforced(params.schema()) if preferred == "auto" and params.kind == "json" else None
    if gap is not None:
        order = ["guidance"]  # enforced by llguidance, or refused: never silently ignored
        errors.append(f"xgrammar: does not enforce {gap}")
    if preferred == "auto" and params.whitespace_pattern is not None:
        order = ["guidance"]  # xgrammar has no whitespace pattern
    if preferred == "auto" and params.kind == "structural_tag":
        order = ["xgrammar"]  # llguidance has no structural tags
    for backend in order:
        try:
            _VALIDATORS[backend](params)
            return replace(params, backend=backend)
        except Exception as e:  # the backend's own parse error: the message says what is wrong
            errors.append(f"{backend}: {_short(e)}")
    raise ValueError(f"{field}: cannot be compiled ({'; '.join(errors)})")


def _check_form(params: StructuredOutputsParams, field: str) -> None:
    kind = params.kind
    if kind == "json":
        _check_schema(_json_object(params.json or "", field, "a JSON schema"), field)
    elif kind == "choice":
        choices = params.choice or []
        if not choices:
            raise ValueError(f"{field}: the choice list must not be empty")
        if not all(isinstance(c, str) for c in choices):
            raise ValueError(f"{field}: every choice must be a string")
    elif kind in ("regex", "grammar", "structural_tag"):
        value = getattr(params, kind)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{field}: the {kind} must be a non-empty string")
    if kind == "structural_tag":
        _json_object(params.structural_tag or "", field, "a structural tag")


def _json_object(text: str, field: str, what: str) -> dict[str, Any]:
    """`text` parsed as a JSON object, else a ValueError naming the field (JSON nested past the
    parser's recursion limit included)."""
    try:
        value = json.loads(text)
    except RecursionError as e:
        raise ValueError(f"{field}: nested too deeply ({e})") from None
    except ValueError as e:
        raise ValueError(f"{field}: is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field}: {what} must be a JSON object, got {type(value).__name__}")
    return value


def _check_schema(schema: dict[str, Any], field: str) -> None:
    """The schema against its metaschema (jsonschema's validator for its $schema, 2020-12 by
    default): a misspelt type or a non-list `required` is a 400, not a silently wrong grammar."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise ValueError(f"{field}: invalid JSON schema{f' at {where}' if where else ''}: "
                         f"{_short(e.message)}") from None


def _short(e: object) -> str:
    text = str(e).strip().splitlines()
    # xgrammar prefixes "[time] /path/file.cc:line: "; keep what it says
    line = " ".join(t.strip() for t in text if t.strip())
    if "] /" in line and ".cc:" in line:
        line = line.split(": ", 1)[-1]
    return line[:400]


# --- per backend: the grammar text each one compiles -------------------------------------------
def choice_ebnf(choices: list[str]) -> str:
    """GBNF for "one of these strings" (xgrammar)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def choice_lark(choices: list[str]) -> str:
    """Lark for "one of these strings" (llguidance)."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def is_ebnf(grammar: str) -> bool:
    """GBNF / EBNF (`rule ::= ...`) rather than Lark (`rule: ...`)."""
    return "::=" in grammar


def xgrammar_grammar(params: StructuredOutputsParams) -> Any:
    """The xgrammar `Grammar` of a spec (parses it: raises on a bad one)."""
    import xgrammar as xgr

    kind = params.kind
    if kind == "json" or kind == "json_object":
        if params.whitespace_pattern is not None:
            raise ValueError("xgrammar has no whitespace_pattern (llguidance has)")
        schema = params.json if kind == "json" and params.json else '{"type": "object"}'
        return xgr.Grammar.from_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex or "")
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(params.choice or []))
    if kind == "grammar":
        text = params.grammar or ""
        return xgr.Grammar.from_ebnf(text) if is_ebnf(text) else xgr.Grammar.from_lark(text)
    return xgr.Grammar.from_structural_tag(_structural_tag(params.structural_tag or ""))


def _structural_tag(text: str) -> Any:
    """xgrammar's structural tag; vLLM's older form ({"structures": [{begin, schema, end}],
    "triggers": [...]}) as its StructuralTagItems."""
    tag = json.loads(text)
    if "structures" not in tag:
        return text
    import xgrammar as xgr

    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in tag["structures"]]
    return xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"]) \
        if hasattr(xgr.StructuralTag, "from_legacy_structural_tag") else (items, tag["triggers"])


def guidance_grammar(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text of a spec (its own JSON form)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    kind = params.kind
    if kind == "json" or kind == "json_object":
        schema = params.json if kind == "json" and params.json else '{"type": "object"}'
        options: Any = {}  # llguidance's JsonCompileOptions
        if params.disable_any_whitespace:
            options["whitespace_flexible"] = False
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        return str(LLMatcher.grammar_from_json_schema(schema, overrides=options or None))
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(params.regex or ""))
    if kind == "choice":
        return str(LLMatcher.grammar_from_lark(choice_lark(params.choice or [])))
    if kind == "grammar":
        text = params.grammar or ""
        return str(LLMatcher.grammar_from_lark(gbnf_to_lark(text) if is_ebnf(text) else text))
    raise ValueError("llguidance has no structural tags")


def _validate_xgrammar(params: StructuredOutputsParams) -> None:
    xgrammar_grammar(params)


def _validate_guidance(params: StructuredOutputsParams) -> None:
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(guidance_grammar(params))
    if error:
        raise ValueError(error)


_VALIDATORS: dict[str, Callable[[StructuredOutputsParams], None]] = {
    "xgrammar": _validate_xgrammar, "guidance": _validate_guidance}
