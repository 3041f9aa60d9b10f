"""Data and evaluation helpers for the embedded demo model.

The demo model is trained on, calibrated with and evaluated on the Python
standard library's own ``.py`` sources, because that text exists on every
machine that can run this package: no download, no hub, no data set.
The split logic lives here (not in the training script) so training,
calibration and evaluation all see exactly the same files.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

SPLITS = ("train", "heldout")

# Directories whose sources are not representative Python (tests, codec
# tables, generated help text) or are not stdlib at all (installed packages).
_EXCLUDED_DIRS = frozenset(
    {
        "__pycache__",
        "dist-packages",
        "encodings",
        "idle_test",
        "pydoc_data",
        "site-packages",
        "test",
        "tests",
    }
)
# A few generated files are huge and would dominate the corpus.
_MAX_FILE_BYTES = 200_000
# One file in _HELDOUT_BUCKETS is held out, chosen by a hash of its path.
_HELDOUT_BUCKETS = 10
# Fixed seed for the order in which calibration windows are drawn.
_CALIBRATION_SEED = 0


def demo_model_path() -> Path:
    """Folder of the demo model shipped as package data (config, weights, tokenizer)."""
    return Path(__file__).resolve().parent.parent / "demo_model"


def _is_excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIRS or name.startswith("config-")


def _stdlib_source_files() -> list[Path]:
    """Every usable stdlib ``.py`` file, sorted by its path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        # Prune in place so os.walk never descends into site-packages etc.
        subdirs[:] = [name for name in subdirs if not _is_excluded_dir(name)]
        for name in names:
            # _sysconfigdata_* is generated and platform specific.
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = Path(directory) / name
                if path.stat().st_size <= _MAX_FILE_BYTES:
                    files.append(path)
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def _split_of(relative_path: str) -> str:
    """Assign a file to a split by hashing its path.

    Hashing (rather than taking every n-th file) keeps a file's split stable
    even when another Python version adds or removes modules.
    """
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return "heldout" if digest[0] % _HELDOUT_BUCKETS == 0 else "train"


@functools.lru_cache(maxsize=len(SPLITS))
def _read_split(split: str) -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(
        path.read_text(encoding="utf-8", errors="replace")
        for path in _stdlib_source_files()
        if _split_of(path.relative_to(root).as_posix()) == split
    )


def stdlib_texts(split: str) -> list[str]:
    """Texts of the stdlib files in ``split`` ("train" or "heldout"), in sorted path order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return list(_read_split(split))


def _token_windows(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], seq_len: int
) -> Iterator[list[int]]:
    """Yield consecutive ``seq_len``-token windows of the texts joined by EOS.

    Tokenizes one text at a time so callers that need few windows stay fast.
    """
    buffer: list[int] = []
    for text in texts:
        buffer.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        buffer.append(tokenizer.eos_token_id)
        start = 0
        while len(buffer) - start >= seq_len:
            yield buffer[start : start + seq_len]
            start += seq_len
        del buffer[:start]


def calibration_dataset(
    tokenizer: PreTrainedTokenizerBase, num_samples: int, seq_len: int
) -> Dataset:
    """``num_samples`` rows of exactly ``seq_len`` train-split tokens, for ``oneshot(dataset=...)``.

    Files are visited in a seeded shuffled order, so the samples come from
    many modules yet are identical on every call.
    """
    texts = stdlib_texts("train")
    random.Random(_CALIBRATION_SEED).shuffle(texts)
    windows: list[list[int]] = []
    for window in _token_windows(tokenizer, texts, seq_len):
        windows.append(window)
        if len(windows) == num_samples:
            break
    if len(windows) < num_samples:
        raise ValueError(f"train split only holds {len(windows)} windows of {seq_len} tokens")
    return Dataset.from_dict(
        {"input_ids": windows, "attention_mask": [[1] * seq_len for _ in windows]}
    )


def _evenly_spaced(items: list[list[int]], count: int) -> list[list[int]]:
    """Pick ``count`` items spread over the whole list, so every part of the text is sampled."""
    if len(items) <= count:
        return items
    return [items[i * len(items) // count] for i in range(count)]


def _log_probs(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Float32 next-token log-probabilities of ``model`` on CPU, whatever its device."""
    logits = model(input_ids=input_ids.to(model.device)).logits
    return F.log_softmax(logits.float().cpu(), dim=-1)


@torch.no_grad()
def kl_divergence(
    reference_model: PreTrainedModel,
    quantized_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    seq_len: int,
    max_chunks: int,
) -> float:
    """Mean per-token KL(reference || quantized) over up to ``max_chunks`` chunks of ``texts``.

    KL against the unquantized model measures how much quantization changed
    the model's predictions, independent of how good the tiny model is.
    Both distributions are compared in float32 on CPU, so the two models may
    live on different devices and in different dtypes.
    """
    chunks = _evenly_spaced(list(_token_windows(tokenizer, texts, seq_len)), max_chunks)
    if not chunks:
        raise ValueError(f"texts hold no complete chunk of {seq_len} tokens")
    total_kl = 0.0
    total_tokens = 0
    for chunk in chunks:
        input_ids = torch.tensor([chunk])
        reference = _log_probs(reference_model, input_ids)
        quantized = _log_probs(quantized_model, input_ids)
        total_kl += F.kl_div(quantized, reference, log_target=True, reduction="sum").item()
        total_tokens += input_ids.numel()
    return total_kl / total_tokens


@torch.no_grad()
def generate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str, max_new_tokens: int
) -> str:
    """Greedy continuation of ``prompt``; returns prompt plus continuation.

    Greedy decoding makes the demo output deterministic, so the original and
    quantized models can be compared side by side.
    """
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
    output = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(output[0], skip_special_tokens=True)
