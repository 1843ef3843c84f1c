"""N-gram prompt lookup (vLLM's `ngram` method): the request's last n tokens are searched for
earlier in its own prompt and output; the tokens that followed the latest earlier occurrence
are the draft. Lengths from `prompt_lookup_max` down to `prompt_lookup_min` are tried, the
longest match wins (a longer shared context predicts better). A match close to the end (a loop
of period p) is continued through the draft itself: draft token j copies the token p places
before it, so a repeating output is drafted `k` tokens ahead, not just to its end."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens following the latest earlier occurrence of the longest suffix of
    `tokens` (length in [min_n, max_n]) that occurs before; [] when none does.

    tokens: [num_tokens] int64, the prompt and outputs so far."""
    num = len(tokens)
    if k < 1 or num < min_n + 1:
        return []
    last = tokens[-1]
    # candidate ends: earlier positions holding the last token (the suffix itself excluded)
    ends = np.flatnonzero(tokens[:-1] == last)
    if len(ends) == 0:
        return []
    matched = np.ones(len(ends), dtype=bool)
    best_n, best_end = 0, -1
    for n in range(1, min(max_n, num - 1) + 1):
        if n > 1:  # extend the match one token further back
            back = ends - (n - 1)
            ok = back >= 0
            matched &= ok
            matched[ok] &= tokens[back[ok]] == tokens[num - n]
        if not matched.any():
            break
        if n >= min_n:
            best_n, best_end = n, int(ends[np.flatnonzero(matched)[-1]])  # the latest match
    if best_n == 0:
        return []
    draft = tokens[best_end + 1:best_end + 1 + k].tolist()
    period = num - 1 - best_end
    while len(draft) < k:  # the match's continuation reaches the end: copy on through the draft
        draft.append(draft[len(draft) - period])
    return draft
