"""Speculative decoding's parts: the config's refusals, n-gram lookup, the adaptive draft length,
and the verifier's acceptance (engine/spec/)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.spec.adaptive import PAUSE_STEPS, DraftBudget
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import propose_ngram
from engine.spec.verify import accepted_tokens, expand_rows


def test_the_config_takes_vllms_json_and_refuses_what_it_does_not_build_by_name() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, '
                                  '"prompt_lookup_min": 2, "prompt_lookup_max": 6}')
    assert cfg == SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_min=2,
                                    prompt_lookup_max=6)
    draft = SpeculativeConfig.parse({"model": "some/draft-model"})  # a model implies draft_model
    assert draft is not None and (draft.method, draft.model) == ("draft_model", "some/draft-model")
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.parse(None) is None
    bad = {
        '{"method": "eagle"}': "speculative_config.method: 'eagle' is not built",
        '{"method": "nonsense"}': "speculative_config.method: must be one of",
        '{"method": "draft_model"}': "speculative_config.model: method draft_model needs",
        '{"method": "suffix", "model": "x"}': "speculative_config.model: names the draft model",
        '{"num_speculative_tokens": 0}': "speculative_config.num_speculative_tokens",
        '{"num_speculative_tokens": true}': "speculative_config.num_speculative_tokens",
        '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}': "speculative_config.prompt_lookup_max",
        '{"disable_by_batch_size": 0}': "speculative_config.disable_by_batch_size",
        '{"num_speculative_token": 3}': "speculative_config.num_speculative_token: is not a key",
        '{"method": ': "speculative_config: not valid JSON",
        '[1, 2]': "speculative_config: must be a JSON object",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            SpeculativeConfig.parse(text)
    # through the engine's config as well
    assert EngineConfig(model="x", speculative_config={"num_speculative_tokens": 2}
                        ).speculative_config == SpeculativeConfig(num_speculative_tokens=2)


def test_ngram_drafts_what_followed_the_latest_longest_match() -> None:
    t = np.array([1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 8, 1, 2, 3], dtype=np.int64)
    # suffix [1 2 3] occurs at 0..2 (then 4) and 6..8 (then 5 8): the latest wins
    assert propose_ngram(t, 2, 1, 3) == [5, 8]
    # [9 9 1 2 3] is matched nowhere past length 3; min 4 finds nothing
    assert propose_ngram(t, 2, 4, 5) == []
    # a longer match beats a later shorter one: [4 7] ... [7] ... ends with [4 7]
    t2 = np.array([4, 7, 10, 11, 3, 7, 20, 4, 7], dtype=np.int64)
    assert propose_ngram(t2, 2, 1, 2) == [10, 11]
    assert propose_ngram(t2, 2, 1, 1) == [20, 4]  # length 1 only: the latest 7
    assert propose_ngram(np.array([5], dtype=np.int64), 3, 1, 3) == []
    assert propose_ngram(np.array([5, 6, 7], dtype=np.int64), 3, 1, 3) == []  # no repeat


def test_a_loop_near_the_end_is_drafted_through_the_draft_itself() -> None:
    t = np.array([3, 8, 8, 8], dtype=np.int64)
    assert propose_ngram(t, 4, 1, 3) == [8, 8, 8, 8]
    t = np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int64)  # period 3
    assert propose_ngram(t, 5, 1, 3) == [3, 1, 2, 3, 1]


def test_the_draft_length_follows_acceptance_and_pauses_after_rejections() -> None:
    b = DraftBudget()
    assert b.length(4) == 4
    b.record(4, 1)  # 1 - 0.3 * 0.75 = 0.775
    assert b.length(4) == 4
    for _ in range(2):
        b.record(4, 0)  # 0.5425, then 0.38
    assert b.length(4) == 2
    b.record(2, 0)  # 0.266
    b.record(2, 0)  # 0.186: paused
    assert [b.length(4) for _ in range(PAUSE_STEPS)] == [0] * (PAUSE_STEPS - 1) + [1]  # a probe
    b.record(1, 1)  # 0.2 + 0.3 * 0.8 = 0.44: half again
    assert b.length(4) == 2


def test_rows_see_the_outputs_and_earlier_drafts_and_acceptance_stops_at_the_first_miss() -> None:
    p = SamplingParams(temperature=0.5, seed=3)
    rows = expand_rows([p, p], [[7], []], [[1, 2], [4]], [[8, 9], []])
    assert rows.output_token_ids == [[7], [7, 8], [7, 8, 9], []]
    assert rows.prompt_token_ids == [[1, 2]] * 3 + [[4]]
    assert rows.num_rows == [3, 1]
    assert accepted_tokens([8, 9, 5], [8, 9]) == 2
    assert accepted_tokens([8, 1, 5], [8, 9]) == 1
    assert accepted_tokens([2, 9, 5], [8, 9]) == 0


def test_the_suffix_trie_counts_substrings_and_forgets_removed_sequences() -> None:
    from engine.spec.suffix import SuffixTrie

    trie = SuffixTrie(depth=3)
    trie.add([1, 2, 3, 1, 2, 4])
    node, m = trie.find([9, 1, 2])  # [1 2] occurred twice, then 3 and 4
    assert m == 2 and node is not None and {t: c.count for t, c in node.children.items()} == {3: 1, 4: 1}
    trie.add([1, 2, 4], delta=-1)
    node, _ = trie.find([1, 2])
    assert node is not None and list(node.children) == [3]
    trie.add([1, 2, 3, 1, 2, 4][:3], delta=-1)
    assert trie.find([1, 2]) == (None, 0)


def test_suffix_drafts_follow_the_most_frequent_continuation_within_the_match_and_probability() -> None:
    from engine.spec.suffix import SuffixProposer

    p = SuffixProposer(depth=8, max_cached_requests=2, max_spec_factor=1.0, min_prob=0.3)
    seq = [10, 11, 12, 13, 14, 15, 10, 11, 12]
    # matched [10 11 12] (3 tokens): at most 3 drafts, continuing with 13 14 15
    assert p.propose("a", seq, 8) == [13, 14, 15]
    # grown incrementally; the match is at most depth - min(k, depth // 2) = 4 tokens long, so
    # the trie (depth 8) has room for the 4 drafts after it
    assert p.propose("a", [*seq, 13, 14, 15, 10], 4) == [11, 12, 13, 14]
    assert p.propose("b", [5, 6, 7], 4) == []  # nothing to match yet
    p.finished("a", [13, 14, 15, 10, 11, 12, 13])  # a's output enters the global trie
    assert p.propose("b", [5, 6, 7, 13, 14], 4) == [15, 10]  # matched [13 14]: 2 drafts at most
    for i in range(3):  # a third cached request pushes a's output out
        p.finished(f"c{i}", [40 + i, 41 + i])
    assert p.propose("b2", [5, 6, 7, 13, 14], 4) == []


def test_the_suffix_method_takes_vllms_keys() -> None:
    cfg = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 12,
                                   "suffix_decoding_min_token_prob": 0.2})
    assert cfg is not None and cfg.num_speculative_tokens == 12  # vLLM: the tree depth
    with pytest.raises(ValueError, match="suffix_decoding_max_spec_factor"):
        SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_spec_factor": 0})
