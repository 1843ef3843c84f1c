"""KV cache events in vLLM's wire format (BlockStored / BlockRemoved / AllBlocksCleared over ZMQ)."""
