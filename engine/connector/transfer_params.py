"""The `kv_transfer_params` a request may carry (vLLM's dict; the router and the offline API pass
it), checked before the request reaches the scheduler: wrong types or sizes fail that request
with a ValueError naming the field, never the engine core.

    {"do_remote_decode": True, "transfer_id": "t1"}                       # to a producer
    {"do_remote_prefill": True, "keys": [...], "num_tokens": 300, ...}    # to a consumer
"""

from __future__ import annotations

from typing import Any

MAX_TEXT = 512  # transfer_id, kv_store_url
_FLAGS = ("do_remote_prefill", "do_remote_decode")
_TEXTS = ("transfer_id", "kv_store_url")
# A producer's hints for metrics (engine/core/request_stats.py): the client's max_tokens and
# min_tokens of the sample it computes the first token of.
_COUNTS = ("sample_max_tokens", "sample_min_tokens")


def check_transfer_params(params: Any, num_prompt_tokens: int, chunk_size: int) -> None:
    """Raises ValueError unless `params` is None or a well-formed kv_transfer_params dict for a
    prompt of `num_prompt_tokens` tokens cut into chunks of `chunk_size`: flags are bools, texts
    short strings, and a remote prefill names at most one LMCache key per chunk and at most
    `num_prompt_tokens` tokens."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params: must be a dict, got {type(params).__name__}")
    for name in _FLAGS:
        if not isinstance(params.get(name, False), bool):
            raise ValueError(f"kv_transfer_params.{name}: must be a bool, got {params[name]!r:.60}")
    for name in _COUNTS:
        value = params.get(name, 0)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"kv_transfer_params.{name}: must be a non-negative integer or null, "
                             f"got {value!r:.60}")
    for name in _TEXTS:
        value = params.get(name, "")
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise ValueError(f"kv_transfer_params.{name}: must be a string of at most {MAX_TEXT} "
                             f"characters")
    tp = params.get("tp_size", 1)
    if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= 64):
        raise ValueError(f"kv_transfer_params.tp_size: must be an integer in [1, 64] (the producer's "
                         f"tensor-parallel size) or null, got {tp!r:.60}")
    if params.get("do_remote_prefill"):
        _check_remote_prefill(params, num_prompt_tokens, chunk_size)


def _check_remote_prefill(params: dict[str, Any], num_prompt_tokens: int, chunk_size: int) -> None:
    from kvstore.lmcache_format import CacheEngineKey

    n = params.get("num_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= num_prompt_tokens:
        raise ValueError(f"kv_transfer_params.num_tokens: must be an integer in [0, "
                         f"{num_prompt_tokens}] (the prompt's length), got {n!r:.60}")
    keys = params.get("keys")
    if not isinstance(keys, list):
        raise ValueError(f"kv_transfer_params.keys: must be a list of strings, got "
                         f"{type(keys).__name__}")
    most = -(-num_prompt_tokens // chunk_size)
    if len(keys) > most:
        raise ValueError(f"kv_transfer_params.keys: {len(keys)} keys for a {num_prompt_tokens}-token "
                         f"prompt (at most {most}, one per {chunk_size}-token chunk)")
    for i, key in enumerate(keys):
        if not isinstance(key, str) or len(key) > MAX_TEXT:
            raise ValueError(f"kv_transfer_params.keys[{i}]: must be a string of at most {MAX_TEXT} "
                             f"characters")
        try:
            parsed = CacheEngineKey.from_string(key)
        except ValueError as e:
            raise ValueError(f"kv_transfer_params.keys[{i}]: not an LMCache CacheEngineKey "
                             f"(model@world_size@worker_id@hash@dtype): {e}") from None
        # the world size says which ranks' objects a load reads (engine/connector/kv_shards.py)
        tp = params.get("tp_size") or parsed.world_size
        if not 1 <= parsed.world_size <= 64 or parsed.world_size != tp or parsed.worker_id != 0:
            raise ValueError(f"kv_transfer_params.keys[{i}]: world_size must be the producer's "
                             f"tp_size ({tp}, in [1, 64]) and worker_id 0 (rank 0's key), got "
                             f"{parsed.world_size} and {parsed.worker_id}")
