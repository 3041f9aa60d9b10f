"""Fast CPU tests for the embedded demo model and its data helpers."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmcompressor_parallel.demo import (
    calibration_dataset,
    demo_model_path,
    generate,
    kl_divergence,
    stdlib_texts,
)

MAX_DEMO_MODEL_BYTES = 20 * 1000 * 1000
SEQ_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()


def test_demo_model_folder_is_complete_and_small() -> None:
    folder = demo_model_path()
    names = {path.name for path in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    assert size <= MAX_DEMO_MODEL_BYTES


def test_demo_model_is_a_quantizable_moe(model) -> None:
    config = model.config
    assert config.model_type == "qwen3_moe"
    assert config.num_experts_per_tok < config.num_local_experts
    # W4A16 with group_size=128 needs every Linear input to split into whole groups.
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert module.in_features % 128 == 0, name


def test_splits_are_disjoint_and_nonempty() -> None:
    train, heldout = stdlib_texts("train"), stdlib_texts("heldout")
    assert train and heldout
    assert not set(train) & set(heldout)


def test_unknown_split_is_rejected() -> None:
    with pytest.raises(ValueError):
        stdlib_texts("validation")


def test_calibration_dataset_shape_and_determinism(tokenizer) -> None:
    first = calibration_dataset(tokenizer, num_samples=4, seq_len=SEQ_LEN)
    second = calibration_dataset(tokenizer, num_samples=4, seq_len=SEQ_LEN)
    assert first.column_names == ["input_ids", "attention_mask"]
    assert len(first) == 4
    assert all(len(row) == SEQ_LEN for row in first["input_ids"])
    assert all(row == [1] * SEQ_LEN for row in first["attention_mask"])
    assert first["input_ids"] == second["input_ids"]
    assert len({tuple(row) for row in first["input_ids"]}) == 4


def test_kl_divergence_of_model_with_itself_is_zero(model, tokenizer) -> None:
    kl = kl_divergence(model, model, tokenizer, stdlib_texts("heldout"), SEQ_LEN, max_chunks=2)
    assert kl == pytest.approx(0.0, abs=1e-6)


def test_kl_divergence_against_perturbed_copy_is_positive(model, tokenizer) -> None:
    perturbed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    kl = kl_divergence(model, perturbed, tokenizer, stdlib_texts("heldout"), SEQ_LEN, max_chunks=2)
    assert kl > 1e-3


def test_generate_is_greedy_and_keeps_prompt(model, tokenizer) -> None:
    first = generate(model, tokenizer, "def ", max_new_tokens=8)
    assert first.startswith("def ")
    assert len(first) > len("def ")
    assert generate(model, tokenizer, "def ", max_new_tokens=8) == first
