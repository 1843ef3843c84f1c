"""Seeds of a seeded request's random draws: one per output position.

A seeded request's token at output position `k` is drawn with a generator seeded with
`position_seed(seed, k)`, nothing else: not the batch, not how many steps the engine ran, not
which worker computed the earlier tokens. This is what keeps a seeded sample's tokens the same
split or colocated, after a preemption, and after a migration (the decode worker is told how
many of its input tokens are earlier outputs, so it knows `k`).
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the draw for output position `position` of a request seeded with
    `seed`: a splitmix64 hash of the pair, so neighbouring seeds and positions give unrelated
    streams (seed s at position k+1 is not seed s+1 at k). In [0, 2**64)."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK64
    return x ^ (x >> 31)
