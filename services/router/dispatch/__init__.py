"""Dispatch: the worker pools, their health and load, the prefix index, the calls in
flight, and prefill -> decode with migration."""
