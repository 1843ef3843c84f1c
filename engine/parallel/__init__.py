"""Tensor parallelism: one model split across `tensor_parallel_size` processes (ranks).

- group.py: the ranks' process group (gloo on CPU, nccl on CUDA) and the two collectives the
  model needs (a sum over ranks after a row-parallel projection, a gather of the vocab shards).
- shard.py: what each rank holds (its heads, its slice of the MLP and of every expert, its rows
  of the vocabulary) and the slice of each checkpoint tensor that fills it.
- channel.py: rank 0's step messages to the other ranks, through shared memory (msgpack, no
  pickle, no socket).
- executor.py / follower.py: rank 0 (the engine core) starts the other ranks, sends each step's
  scheduler output to them and watches them; the other ranks run the same forward and never
  sample.
"""
