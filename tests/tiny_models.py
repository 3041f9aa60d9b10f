"""Tiny dense and MoE models, a local tokenizer and calibration data, all offline.

Each test that compares stock and parallel modifiers builds its model from a config
with a fixed seed and saves it (with a word-level tokenizer) to a folder, so that
`oneshot(model=path)` loads it exactly as a user's local checkpoint would be.
"""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
)

VOCAB = 512


def word_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab["<unk>"] = vocab_size - 2
    vocab["<eos>"] = vocab_size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>"
    )


def dense_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )


def save_tiny_model(kind: str, folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = dense_config() if kind == "dense" else moe_config()
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def calibration_data(num_samples: int = 16, seq_len: int = 32, seed: int = 0) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 2, (num_samples, seq_len), generator=generator)
    return Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": [[1] * seq_len] * num_samples}
    )


def load_saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized int32 words -> one int per 4-bit value."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def decoder_layer_and_inputs(device: str = "cpu", batch: int = 5, seq_len: int = 16):
    """A dense decoder layer with two trainable weights, and kwargs for one call.

    The attention mask is per sample (split over replicas); the rotary embeddings
    have batch 1 (copied to every replica).
    """
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    config = dense_config()
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).to(device)
    for param in layer.parameters():
        param.requires_grad_(False)
    layer.mlp.up_proj.weight.requires_grad_(True)
    layer.self_attn.q_proj.weight.requires_grad_(True)
    hidden = torch.randn(batch, seq_len, config.hidden_size, device=device)
    positions = torch.arange(seq_len, device=device)[None]
    position_embeddings = LlamaRotaryEmbedding(config).to(device)(hidden, positions)
    mask = torch.full((batch, 1, seq_len, seq_len), float("-inf"), device=device).triu(1)
    return layer, dict(hidden_states=hidden, position_embeddings=position_embeddings, attention_mask=mask)
