"""KV connectors: how an engine's KV blocks leave for and arrive from outside (vLLM's
KVConnectorBase_V1), split into a scheduler half (no tensors) and a worker half (tensors)."""
