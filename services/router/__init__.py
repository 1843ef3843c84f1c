"""The OpenAI-compatible HTTP router: validates, tokenizes, dispatches to prefill + decode workers."""
