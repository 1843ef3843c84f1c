"""The structured-outputs benchmark's workload: 16 realistic JSON schemas and one chat prompt each.

Every schema is bounded (strings with maxLength, arrays with maxItems, integers with ranges, no
extra properties) so a constrained output always ends well within the benchmark's max_tokens.
"""

from __future__ import annotations

from typing import Any


def _s(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _list(item: dict[str, Any], max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": item, "minItems": 1, "maxItems": max_items}


def _obj(**props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


# (what the prompt asks for, the schema of the answer)
TASKS: list[tuple[str, dict[str, Any]]] = [
    ("a fictional person: name, age and city",
     _obj(name=_s(24), age=_int(0, 120), city=_s(24))),
    ("a postal address in Paris",
     _obj(street=_s(32), postcode=_s(8), city=_s(20), country=_s(20))),
    ("a laptop for sale in an online shop",
     _obj(sku=_s(12), title=_s(40), price_eur=_int(1, 5000), in_stock={"type": "boolean"})),
    ("an order of two books",
     _obj(order_id=_s(12), items=_list(_obj(title=_s(32), quantity=_int(1, 9)), 3),
          status=_enum("pending", "shipped", "delivered"))),
    ("a conference talk on databases",
     _obj(title=_s(48), speaker=_s(24), room=_s(8), minutes=_int(5, 120))),
    ("today's weather in Oslo",
     _obj(city=_s(20), temperature_c=_int(-50, 50), sky=_enum("clear", "cloudy", "rain", "snow"),
          wind_kmh=_int(0, 200))),
    ("a classic novel",
     _obj(title=_s(40), author=_s(32), year=_int(1500, 2025), genres=_list(_s(16), 3))),
    ("a short review of a science-fiction film",
     _obj(film=_s(32), stars=_int(1, 5), summary=_s(80), recommend={"type": "boolean"})),
    ("a user account on a forum",
     _obj(username=_s(16), email=_s(32), role=_enum("member", "moderator", "admin"),
          posts=_int(0, 100000))),
    ("one line of an invoice for consulting work",
     _obj(description=_s(48), hours=_int(1, 200), rate_eur=_int(1, 500),
          currency=_enum("EUR", "USD", "GBP"))),
    ("a flight from Berlin to Rome",
     _obj(flight=_s(8), origin=_s(3), destination=_s(3), departure=_s(16), seats_left=_int(0, 400))),
    ("a recipe for pancakes",
     _obj(dish=_s(24), servings=_int(1, 12), ingredients=_list(_s(20), 4), minutes=_int(1, 240))),
    ("a job posting for a backend engineer",
     _obj(title=_s(40), company=_s(24), remote={"type": "boolean"},
          level=_enum("junior", "mid", "senior"), skills=_list(_s(16), 3))),
    ("a reading from a temperature sensor",
     _obj(sensor_id=_s(12), celsius={"type": "number", "minimum": -40, "maximum": 125},
          battery_pct=_int(0, 100), ok={"type": "boolean"})),
    ("a bug report about a crash on start-up",
     _obj(title=_s(48), severity=_enum("low", "medium", "high", "critical"),
          labels=_list(_s(12), 3), reproducible={"type": "boolean"})),
    ("a meeting in a calendar",
     _obj(subject=_s(40), day=_enum("mon", "tue", "wed", "thu", "fri"), start_hour=_int(0, 23),
          attendees=_list(_s(20), 4))),
]


def messages(task: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You answer with one JSON object and nothing else."},
            {"role": "user", "content": f"Give me {task} as JSON."}]


def fresh_schema(tag: str) -> dict[str, Any]:
    """A schema no run has compiled before (its property name carries `tag`)."""
    return _obj(**{f"answer_{tag}": _s(24), "confidence": _int(0, 100)})
