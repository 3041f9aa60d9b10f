"""Chat-formatted calibration samples for the examples (needs hub access to the data set)."""

from datasets import Dataset, load_dataset
from transformers import AutoTokenizer


def chat_calibration(model: str, samples: int, seq_len: int) -> Dataset:
    """`samples` UltraChat conversations in the model's chat template, tokenized."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = load_dataset("HuggingFaceH4/ultrachat_200k", split=f"train_sft[:{samples}]")
    return rows.map(
        lambda row: tokenizer(
            tokenizer.apply_chat_template(row["messages"], tokenize=False),
            max_length=seq_len, truncation=True, add_special_tokens=False,
        ),
        remove_columns=rows.column_names,
    )
