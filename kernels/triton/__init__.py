"""Triton GPU kernels (paged KV cache write, paged decode and prefill attention), each next to a
plain-PyTorch reference of the same function. Without a GPU they run in Triton's interpreter
(`TRITON_INTERPRET=1`, CPU tensors), which the tests use."""
