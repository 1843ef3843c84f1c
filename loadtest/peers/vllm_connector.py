"""vLLM's ExampleConnector with one crash fixed; loaded by `vllm serve` in loadtest/peers/vllm_pd.py.

vLLM 0.32.0's ExampleConnector looks a prompt up under the hash of its first
`align(len - 1)` tokens, `align(n) = (n - 1) // block_size * block_size`, and reports
`align(len - 1) - num_computed_tokens` tokens to load. That is negative when the prompt is one
token long (align(0) = -block_size, and the key of the empty prefix exists once any prompt of at
most block_size tokens was stored) or when the local prefix cache already holds more than the
stored prefix; the scheduler then indexes out of range and the EngineCore dies. Clamping the
count at zero (nothing to load: compute locally) is the whole fix; the rest is vLLM's code.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class SafeExampleConnector(ExampleConnector):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (None if count is None else max(0, count)), load_async
