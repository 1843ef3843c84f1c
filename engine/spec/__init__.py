"""Speculative decoding (docs/speculative-decoding.md): proposers guess the next tokens of a
decoding request, the target model checks them all in one forward, and the verifier keeps the
tokens non-speculative decoding would have emitted, so output never changes."""
