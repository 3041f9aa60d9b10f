"""Random-weight models at the layer shapes of real checkpoints, built offline."""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3MoeConfig

VOCAB = 32000


def llama3_8b(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, dtype="bfloat16",
    )


def qwen3_30b_a3b(layers: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, max_position_embeddings=8192, dtype="bfloat16",
    )


def qwen3_235b_a22b(layers: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, max_position_embeddings=8192, dtype="bfloat16",
    )


def tiny_dense(layers: int) -> LlamaConfig:
    """For smoke-testing the scripts on a CPU."""
    return LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, dtype="bfloat16")


def tiny_moe(layers: int) -> Qwen3MoeConfig:
    """For smoke-testing the scripts on a CPU."""
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          num_experts=8, num_experts_per_tok=2, dtype="bfloat16")


def tiny_moe_128(layers: int) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's expert count and top-k at tiny widths: per-call host work on a CPU."""
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=128, num_experts_per_tok=8, dtype="bfloat16")


SHAPES = {"tiny-dense": tiny_dense, "tiny-moe": tiny_moe, "tiny-moe-128": tiny_moe_128, "llama3-8b": llama3_8b, "qwen3-30b-a3b": qwen3_30b_a3b, "qwen3-235b-a22b": qwen3_235b_a22b}


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<unk>": VOCAB - 2, "<eos>": VOCAB - 1})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   eos_token="<eos>", pad_token="<eos>")


def save_random_model(shape: str, layers: int, folder: Path) -> Path:
    """Random bf16 weights (initialised on the GPU when there is one: much faster)."""
    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    config = SHAPES[shape](layers)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def random_tokens(samples: int, seq_len: int, seed: int = 0) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 2, (samples, seq_len), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq_len] * samples})
