"""Prefill / decode gRPC workers (server) and their typed client."""
