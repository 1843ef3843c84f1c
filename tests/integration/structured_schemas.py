"""A suite of structured-output cases for end-to-end tests: 32 JSON schemas, 5 regexes and 4
choice lists, each with a chat prompt that asks for it. Shared by the engine's suite
(tests/integration/test_structured_schema_suite.py) and the services' runs.

    from tests.integration.structured_schemas import CASES, SUBSET

    for case in CASES:
        messages = case.messages()              # chat messages asking for the output
        spec = case.structured_outputs()        # {"json": schema} | {"regex": r} | {"choice": [...]}
        params = case.params()                  # the engine's StructuredOutputsParams
        case.check(text)                        # AssertionError naming the case when invalid

The schemas are written for a small model (the default, SmolLM2-135M): strings bounded by
maxLength, arrays by maxItems, numbers by minimum/maximum, so a sample ends well within
MAX_TOKENS. They cover nested objects, arrays with minItems/maxItems, enums, const, bounded
integers and numbers, required and optional fields, nullable types, anyOf, prefixItems,
$ref/$defs, patterns and the string formats xgrammar supports (date, date-time, email, uuid,
ipv4, ipv6). Outputs are checked with `jsonschema` and a format checker (see `format_checker`
for dates), regexes with `re.fullmatch`.
`SUBSET` is a representative few for quick runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 320  # enough for every case's longest valid output from the default model

_S = {"type": "string"}


def _str(max_length: int, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **kw}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


_POINT = _obj({"x": _int(-100, 100), "y": _int(-100, 100)})
_PERSON_LITE = _obj({"name": _str(20), "phone": {"type": "string",
                                                  "pattern": r"^[0-9]{3}-[0-9]{4}$"}})

# name -> (what to ask for, JSON schema)
SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": ("Describe a person: name, age and email address.",
               _obj({"name": _str(20), "age": _int(0, 120),
                     # bounded: at temperature 1.0 an unbounded address can run to max_tokens
                     "email": _str(40, format="email")})),
    "book": ("Describe a famous book: title, author, year and up to three genres.",
             _obj({"title": _str(40), "author": _str(30), "year": _int(1400, 2025),
                   "genres": {"type": "array", "minItems": 1, "maxItems": 3,
                              "items": {"enum": ["fiction", "history", "science", "poetry",
                                                 "mystery", "romance"]}}})),
    "address": ("Give a postal address in Germany or France.",
                _obj({"street": _str(30), "city": _str(20),
                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                      "country": {"enum": ["DE", "FR"]}})),
    "order": ("Create a shop order with an id, one to three items and a total price.",
              _obj({"id": {"type": "string", "format": "uuid"},
                    "items": {"type": "array", "minItems": 1, "maxItems": 3,
                              "items": _obj({"sku": {"type": "string",
                                                     "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                             "qty": _int(1, 10)})},
                    "total": _num(0, 1000)})),
    "event": ("Plan a birthday party: name, date and number of guests.",
              _obj({"name": _str(30), "date": {"type": "string", "format": "date"},
                    "guests": _int(1, 200)})),
    "log_entry": ("Write one server log entry with a timestamp, a level and a message.",
                  _obj({"timestamp": {"type": "string", "format": "date-time"},
                        "level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
                        "message": _str(40)})),
    "server": ("Describe a web server: hostname, IPv4 address and port.",
               _obj({"hostname": _str(30), "ip": {"type": "string", "format": "ipv4"},
                     "port": _int(1, 65535)})),
    "line": ("Give a line segment as two points.",
             {"$defs": {"point": _POINT}, "type": "object",
              "properties": {"start": {"$ref": "#/$defs/point"},
                             "end": {"$ref": "#/$defs/point"}},
              "required": ["start", "end"], "additionalProperties": False}),
    "weather": ("Report the weather in a city.",
                _obj({"city": _str(20), "temp_c": _num(-50, 60),
                      "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                      "humidity": _int(0, 100)})),
    "optional_fields": ("Describe a car; the color is optional.",
                        _obj({"make": _str(20), "model": _str(20), "year": _int(1950, 2025),
                              "color": _str(15)}, required=["make", "model"])),
    "flags": ("Give the feature flags of an app.",
              _obj({"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"},
                    "telemetry": {"type": "boolean"}})),
    "nullable": ("Describe a user; the nickname may be null.",
                 _obj({"username": _str(20), "nickname": {"type": ["string", "null"],
                                                          "maxLength": 15}})),
    "contact_any_of": ("Give a contact: an email or a phone number.",
                       _obj({"name": _str(20),
                             "contact": {"anyOf": [
                                 _obj({"email": _str(40, format="email")}),  # as person's
                                 _obj({"phone": {"type": "string",
                                                 "pattern": "^[0-9]{3}-[0-9]{4}$"}})]}})),
    "product_const": ("Describe a product priced in US dollars.",
                      _obj({"name": _str(30), "price": _num(0, 10000),
                            "currency": {"const": "USD"}})),
    "matrix": ("Give a 2x2 matrix of small integers.",
               _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                              "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                        "items": _int(-9, 9)}}})),
    "color": ("Give an RGB color.",
              _obj({"r": _int(0, 255), "g": _int(0, 255), "b": _int(0, 255)})),
    "pair_prefix_items": ("Give a word and its length.",
                          _obj({"pair": {"type": "array", "prefixItems": [_str(15), _int(0, 15)],
                                         "items": False, "minItems": 2}})),
    "enum_numbers": ("Roll a die.", _obj({"roll": {"enum": [1, 2, 3, 4, 5, 6]}})),
    "profile_nested": ("Describe a user profile with settings.",
                       _obj({"user": _obj({"id": _int(1, 99999), "name": _str(20)}),
                             "settings": _obj({"language": {"enum": ["en", "de", "fr", "es"]},
                                               "notifications": {"type": "boolean"},
                                               "theme": {"enum": ["light", "dark"]}})})),
    "movie": ("Describe a movie: title, year, rating and up to three actors.",
              _obj({"title": _str(40), "year": _int(1900, 2025), "rating": _num(0, 10),
                    "cast": {"type": "array", "maxItems": 3, "items": _str(25)}})),
    "recipe": ("Give a short recipe with ingredients and steps.",
               _obj({"name": _str(30),
                     "ingredients": {"type": "array", "minItems": 1, "maxItems": 3,
                                     "items": _obj({"item": _str(20), "grams": _int(1, 1000)})},
                     "steps": {"type": "array", "minItems": 1, "maxItems": 3,
                               "items": _str(40)}})),
    "flight": ("Describe a flight between two airports.",
               _obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                     "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                     "departure": {"type": "string", "format": "date-time"},
                     "seats": _int(1, 400)})),
    "grades": ("Give a student's grades.",
               _obj({"student": _str(20), "grades": {"type": "array", "minItems": 1,
                                                     "maxItems": 5, "items": _int(0, 100)},
                     "passed": {"type": "boolean"}})),
    "bounds_exclusive": ("Give a probability and a positive count.",
                         _obj({"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                               "count": {"type": "integer", "exclusiveMinimum": 0,
                                         "exclusiveMaximum": 1000}})),
    "inventory": ("Count the boxes in a store room (boxes come in fives).",
                  _obj({"room": _str(15), "boxes": {"type": "integer", "multipleOf": 5,
                                                    "minimum": 0, "maximum": 500}})),
    "api_response": ("Write an API response with a status, data and errors.",
                     _obj({"status": {"enum": ["ok", "error"]},
                           "data": _obj({"id": _int(0, 9999), "valid": {"type": "boolean"}}),
                           "errors": {"type": "array", "maxItems": 2, "items": _str(30)}})),
    "calendar": ("Add a meeting to a calendar.",
                 _obj({"id": {"type": "string", "format": "uuid"}, "title": _str(30),
                       "day": {"type": "string", "format": "date"}})),
    "network": ("Describe a network interface with IPv4 and IPv6 addresses.",
                _obj({"name": _str(10), "ipv4": {"type": "string", "format": "ipv4"},
                      "ipv6": {"type": "string", "format": "ipv6"}})),
    "pet_ref": ("Describe a pet and its owner.",
                {"$defs": {"owner": _PERSON_LITE}, "type": "object",
                 "properties": {"species": {"enum": ["dog", "cat", "bird"]},
                                "age": _int(0, 30), "vaccinated": {"type": "boolean"},
                                "owner": {"$ref": "#/$defs/owner"}},
                 "required": ["species", "age", "owner"], "additionalProperties": False}),
    "sentiment": ("Rate the sentiment of: 'I love this phone'.",
                  _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                        "score": _num(0, 1)})),
    "short_email": ("Give a short email address.",  # llguidance: xgrammar ignores maxLength here
                    _obj({"email": _str(24, format="email")})),
    "all_of": ("Give an id and a label.",  # llguidance: xgrammar does not enforce allOf of two
               {"allOf": [_obj({"id": _int(1, 100)}, required=["id"]) | {
                   "additionalProperties": True},
                          {"type": "object", "properties": {"label": _str(10)},
                           "required": ["label"]}]}),
}

# name -> (what to ask for, regex the whole output matches)
REGEXES: dict[str, tuple[str, str]] = {
    "phone": ("Give a US phone number.", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    "iso_date": ("What is today's date?", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    "version": ("What version of Python do you like?", r"v[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,2}"),
    "hex_color": ("Pick a color as a hex code.", r"#[0-9a-f]{6}"),
    "answer": ("Is the sky blue? Answer yes or no and a short reason.",
               r"(Yes|No), [a-z ]{1,30}\."),
}

# name -> (what to ask for, choices)
CHOICES: dict[str, tuple[str, list[str]]] = {
    "capital": ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"]),
    "sentiment_label": ("Is 'great food, slow service' positive, negative or mixed?",
                        ["positive", "negative", "mixed"]),
    "primary_color": ("Name a primary color.", ["red", "yellow", "blue"]),
    "yes_no": ("Is water wet?", ["yes", "no"]),
}


_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"


def _rfc3339(pattern: str) -> Any:
    def check(value: object) -> bool:
        return not isinstance(value, str) or re.fullmatch(pattern, value) is not None
    return check


def format_checker() -> Any:
    """jsonschema's format checker, with "date" and "date-time" checked as RFC 3339 writes them
    (fields in range, leap seconds allowed) and not against the calendar: neither backend's
    grammar knows the calendar (both allow year 0000 and February 29 of any year, xgrammar also
    February 30 and April 31), so a valid sample may name a day that never was."""
    import jsonschema

    checker = jsonschema.FormatChecker()
    checker.checks("date")(_rfc3339(_DATE))
    checker.checks("date-time")(_rfc3339(f"{_DATE}[Tt]{_TIME}"))
    return checker


@dataclass(frozen=True)
class Case:
    """One structured-output request: a prompt and what its output must be."""

    name: str
    kind: str  # "json" | "regex" | "choice"
    prompt: str
    spec: Any  # the JSON schema (dict), the regex (str) or the choices (list[str])

    def messages(self) -> list[dict[str, str]]:
        ask = {"json": "Answer with a JSON object only.", "regex": "Answer briefly.",
               "choice": "Answer with one word."}[self.kind]
        return [{"role": "user", "content": f"{self.prompt} {ask}"}]

    def structured_outputs(self) -> dict[str, Any]:
        """The API form (the router's `structured_outputs` / vLLM's field names)."""
        return {self.kind: self.spec}

    def params(self, **kw: Any) -> Any:
        from engine.structured.params import StructuredOutputsParams

        return StructuredOutputsParams(**self.structured_outputs(), **kw)

    def check(self, text: str) -> None:
        """AssertionError (naming the case and the text) unless `text` is a valid output."""
        if self.kind == "regex":
            assert re.fullmatch(self.spec, text), f"{self.name}: {text!r} !~ {self.spec}"
        elif self.kind == "choice":
            assert text in self.spec, f"{self.name}: {text!r} not in {self.spec}"
        else:
            import jsonschema

            try:
                value = json.loads(text)
                jsonschema.validate(value, self.spec, format_checker=format_checker())
            except (ValueError, jsonschema.ValidationError) as e:
                raise AssertionError(f"{self.name}: {text!r}: {str(e)[:300]}") from None


CASES: list[Case] = (
    [Case(n, "json", p, s) for n, (p, s) in SCHEMAS.items()]
    + [Case(n, "regex", p, r) for n, (p, r) in REGEXES.items()]
    + [Case(n, "choice", p, c) for n, (p, c) in CHOICES.items()]
)
_BY_NAME = {c.name: c for c in CASES}
# a few of each kind with short outputs: $ref, formats, nested objects, anyOf, llguidance's share
SUBSET: list[Case] = [_BY_NAME[n] for n in (
    "line", "event", "contact_any_of", "short_email", "phone", "capital")]
