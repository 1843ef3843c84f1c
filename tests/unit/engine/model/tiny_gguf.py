"""A tiny random Gemma 3 GGUF file (no chat template, like the catalog's gemma-3-270m), written
with the `gguf` package, for conversion and resolution tests that need no network."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType
from gguf.quants import quantize

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
WORDS = ["\u2581", "\n", "\u2581the", "\u2581cat", "\u2581sat", "\u2581hi", "user", "model", "th", "at"]
TOKENS = SPECIALS + WORDS + list("abcdefghijklmnopqrstuvwxyz.,!?")
END_OF_TURN = SPECIALS.index("<end_of_turn>")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 2, 1, 32, 64, 2


def write_tiny_gemma3(path: Path, seed: int = 0, rope_linear_factor: float | None = None) -> Path:
    """The file at `path`; `rope_linear_factor` adds linear RoPE scaling (as Gemma 3 4B's file has)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny gemma3")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(16)
    if rope_linear_factor is not None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_linear_factor)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * len(TOKENS))
    writer.add_token_types([TokenType.UNKNOWN if t == "<unk>" else TokenType.CONTROL if t in SPECIALS
                            else TokenType.NORMAL for t in TOKENS])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    def matrix(name: str, rows: int, cols: int) -> None:  # Q8_0, as real files hold most weights
        data = rng.standard_normal((rows, cols)).astype(np.float32) * 0.2
        q8 = GGMLQuantizationType.Q8_0
        writer.add_tensor(name, quantize(data, q8), raw_dtype=q8)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", len(TOKENS), HIDDEN)
    norm("output_norm.weight", HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}"
        matrix(f"{b}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{b}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{b}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{b}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        matrix(f"{b}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"{b}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"{b}.ffn_down.weight", HIDDEN, FFN)
        for name, size in (("attn_norm", HIDDEN), ("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM),
                           ("post_attention_norm", HIDDEN), ("ffn_norm", HIDDEN), ("post_ffw_norm", HIDDEN)):
            norm(f"{b}.{name}.weight", size)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
