"""Suffix decoding (vLLM's `suffix` method, after Arctic's SuffixDecoding): a trie of every
substring of up to `depth` tokens of a token sequence, each node counting how often its path
occurred, built incrementally as tokens arrive. A draft continues the longest suffix of the
request's tokens found in the trie with a node's most frequent child, while the product of the
children's shares stays at least `min_prob`, for at most `max_spec_factor` x the match length
tokens.

Two tries are consulted: the request's own (its prompt and outputs) and, optionally, one over
the outputs of the worker's last `max_cached_requests` finished requests (an agent's repeated
tool calls, a rewrite's recurring phrasing); the draft with the higher expected number of
accepted tokens (the sum of its cumulative shares) wins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every substring of up to `depth` tokens of the sequences added to it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], delta: int = 1) -> None:
        """Adds (delta 1) or removes (delta -1) every substring of `tokens` up to `depth`."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    if delta < 0:
                        break
                    child = node.children[token] = _Node()
                child.count += delta
                if child.count <= 0:
                    del node.children[token]
                    break
                node = child

    def find(self, context: Sequence[int], room: int = 1) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (at most depth - room tokens, so that
        `room` tokens can follow it in the trie) whose path has a continuation, and that
        suffix's length; (None, 0) when none has."""
        for m in range(min(len(context), self.depth - room), 0, -1):
            node: _Node | None = self.root
            for token in context[len(context) - m:]:
                node = node.children.get(token) if node is not None else None
                if node is None:
                    break
            if node is not None and node.children:
                return node, m
        return None, 0


class _Growing:
    """A request's own trie, fed as its tokens arrive: the paths of the last `depth` starts are
    kept open and each new token extends them (depth steps a token)."""

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.open: list[_Node] = []  # the node of each still-growing substring, oldest first
        self.num_tokens = 0

    def extend(self, tokens: Sequence[int]) -> None:
        depth = self.trie.depth
        for token in tokens:
            self.open.append(self.trie.root)
            if len(self.open) > depth:
                self.open.pop(0)
            grown = []
            for node in self.open:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                grown.append(child)
            self.open = grown
        self.num_tokens += len(tokens)


def continue_from(node: _Node, match_len: int, k: int, max_spec_factor: float,
                  min_prob: float) -> tuple[list[int], float]:
    """The draft from `node` (the most frequent child each time) and its expected accepted
    tokens (the sum of the cumulative shares)."""
    limit = min(k, int(max_spec_factor * match_len))
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < limit and node.children:
        total = sum(c.count for c in node.children.values())
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / total
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        node = child
    return draft, score


class SuffixProposer:
    def __init__(self, depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_prob: float) -> None:
        self.depth = depth
        self.max_cached = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_prob = min_prob
        self._requests: dict[str, _Growing] = {}
        self._outputs: OrderedDict[str, list[int]] = OrderedDict()  # the global trie's, oldest first
        self._global = SuffixTrie(depth)

    def propose(self, req_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` drafts after `tokens` (the request's prompt and outputs so far)."""
        own = self._requests.get(req_id)
        if own is None:
            own = self._requests[req_id] = _Growing(self.depth)
        own.extend(tokens[own.num_tokens:])
        context = tokens[max(0, len(tokens) - self.depth):]
        best: tuple[list[int], float] = ([], 0.0)
        room = max(1, min(k, self.depth // 2))  # a match leaves the trie room for the draft
        for trie in (own.trie, self._global):
            node, m = trie.find(context, room)
            if node is not None:
                found = continue_from(node, m, k, self.max_spec_factor, self.min_prob)
                if found[1] > best[1]:
                    best = found
        return best[0]

    def finished(self, req_id: str, output_token_ids: Sequence[int] | None) -> None:
        """Forgets the request's trie; its outputs (when given) enter the global trie, the
        oldest cached request's leaving it past `max_cached_requests`."""
        self._requests.pop(req_id, None)
        if not output_token_ids or self.max_cached <= 0:
            return
        self._outputs[req_id] = list(output_token_ids)
        self._global.add(output_token_ids)
        while len(self._outputs) > self.max_cached:
            _, old = self._outputs.popitem(last=False)
            self._global.add(old, delta=-1)
