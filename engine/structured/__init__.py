"""Structured outputs (vLLM's "guided decoding"): output constrained to a JSON schema, a regex, a
choice, a grammar or a structural tag.

- `params.py`: `StructuredOutputsParams`, what a request asks for (on `SamplingParams`).
- `select.py`: checks a spec and picks the backend that compiles it (xgrammar, else llguidance,
  as vLLM's `auto`); the front ends call it, so bad specs are refused before any engine.
- `xgrammar_gaps.py`: the JSON schemas xgrammar compiles but does not fully enforce (those go
  to llguidance).
- `backends.py`: the two backends behind one small interface (compile, matcher).
- `manager.py`: compiles grammars off the scheduler's thread, caches them by spec, fills one
  step's token bitmask for every constrained row.
- `bitmask.py`: applies a bitmask to logits (and the PyTorch reference it is tested against).
"""
