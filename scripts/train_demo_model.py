"""Train the tiny Mixture-of-Experts demo model shipped in ``llmcompressor_parallel/demo_model``.

The model is a 4-layer Qwen3-MoE causal LM trained for a fixed number of
steps on the Python standard library's own sources, so the whole pipeline
runs offline on any machine in a few CPU minutes and gives the same result
on every run on the same software stack. Every Linear input dimension is a
multiple of 128, so W4A16 quantization with ``group_size=128`` applies to
all of them.

Usage (with the package importable, e.g. ``pip install -e .``)::

    python scripts/train_demo_model.py
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
)

from llmcompressor_parallel.demo.data import demo_model_path, generate, stdlib_texts

SEED = 0
EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 256
BATCH_SIZE = 8
STEPS = 1000
WARMUP_STEPS = 100
PEAK_LR = 2e-3
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
EVAL_EVERY = 200
EVAL_BATCHES = 8
LOG_EVERY = 20
MAX_SIZE_BYTES = 20 * 1000 * 1000
# No trailing spaces: byte-level BPE attaches a space to the word after it, so a
# prompt ending in a bare space starts from a token the model has rarely seen.
SAMPLE_PROMPTS = ("def", "def get_", "def __init__(self")
# Linear layers take hidden_size, num_attention_heads * head_dim or
# moe_intermediate_size inputs; all must be multiples of the quantization group.
QUANT_GROUP_SIZE = 128


def seed_everything(seed: int, threads: int) -> None:
    """Fix every source of randomness, and the thread count, which changes CPU reduction order."""
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE, so any text (including odd bytes in stdlib files) round-trips exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=SEQ_LEN * 4,
    )


def tokenize_corpus(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One long token stream, files separated by EOS, from which training windows are cut."""
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def build_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeConfig:
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=SEQ_LEN * 4,
        tie_word_embeddings=False,
        output_router_logits=True,  # adds the load-balancing loss so every expert gets trained
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    linear_inputs = {
        "hidden_size": config.hidden_size,
        "num_attention_heads * head_dim": config.num_attention_heads * config.head_dim,
        "moe_intermediate_size": config.moe_intermediate_size,
        "intermediate_size": config.intermediate_size,
    }
    for name, size in linear_inputs.items():
        if size % QUANT_GROUP_SIZE:
            raise ValueError(f"{name}={size} is not a multiple of {QUANT_GROUP_SIZE}")
    return config


def sample_batch(stream: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - SEQ_LEN, (BATCH_SIZE,), generator=generator)
    return torch.stack([stream[start : start + SEQ_LEN] for start in starts.tolist()])


def learning_rate(step: int) -> float:
    """Linear warmup, then cosine decay to MIN_LR_RATIO of the peak."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, STEPS - WARMUP_STEPS)
    cosine = 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())
    return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * cosine)


@torch.no_grad()
def evaluate(model: PreTrainedModel, batches: list[torch.Tensor]) -> float:
    """Mean language-modelling loss (without the router loss) on fixed held-out batches."""
    model.eval()
    losses = [
        model(input_ids=batch, labels=batch, output_router_logits=False).loss.item()
        for batch in batches
    ]
    model.train()
    return sum(losses) / len(losses)


def train(
    model: PreTrainedModel, train_stream: torch.Tensor, heldout_batches: list[torch.Tensor]
) -> float:
    """Run STEPS AdamW steps; returns the mean training loss over the last EVAL_EVERY steps."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(SEED)
    recent_losses: list[float] = []
    model.train()
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        batch = sample_batch(train_stream, generator)
        output = model(input_ids=batch, labels=batch)
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # output.loss includes the router loss; report the language-modelling part.
        lm_loss = output.loss.item() - model.config.router_aux_loss_coef * output.aux_loss.item()
        recent_losses = (recent_losses + [lm_loss])[-EVAL_EVERY:]
        if step % LOG_EVERY == 0 or step == STEPS - 1:
            lr = learning_rate(step)
            print(f"step {step:4d}  lr {lr:.2e}  train loss {lm_loss:.3f}", flush=True)
        if (step + 1) % EVAL_EVERY == 0:
            heldout_loss = evaluate(model, heldout_batches)
            print(f"step {step:4d}  held-out loss {heldout_loss:.3f}", flush=True)
    return sum(recent_losses) / len(recent_losses)


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> int:
    """Save bf16 weights, config and tokenizer; fail if the folder exceeds the size budget."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.config.output_router_logits = False
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    size = folder_size(out_dir)
    if size > MAX_SIZE_BYTES:
        raise RuntimeError(
            f"demo model is {size / 1e6:.1f} MB, over the {MAX_SIZE_BYTES / 1e6:.0f} MB budget"
        )
    return size


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out-dir", type=Path, default=demo_model_path(), help="where to save the model"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (fixed for reproducibility)"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    seed_everything(SEED, args.threads)
    started = time.perf_counter()

    train_texts = stdlib_texts("train")
    heldout_texts = stdlib_texts("heldout")
    tokenizer = build_tokenizer(train_texts)
    train_stream = tokenize_corpus(tokenizer, train_texts)
    heldout_stream = tokenize_corpus(tokenizer, heldout_texts)
    print(
        f"{len(train_texts)} train files ({len(train_stream):,} tokens), "
        f"{len(heldout_texts)} held-out files ({len(heldout_stream):,} tokens), "
        f"vocab {len(tokenizer)}"
    )
    heldout_generator = torch.Generator().manual_seed(SEED + 1)
    heldout_batches = [
        sample_batch(heldout_stream, heldout_generator) for _ in range(EVAL_BATCHES)
    ]

    model = AutoModelForCausalLM.from_config(build_config(tokenizer))
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters")
    print(f"step    0  held-out loss {evaluate(model, heldout_batches):.3f} (untrained)")
    final_loss = train(model, train_stream, heldout_batches)
    train_seconds = time.perf_counter() - started

    size = save(model, tokenizer, args.out_dir)
    print(f"final train loss (mean of last {EVAL_EVERY} steps) {final_loss:.3f}")
    print(f"trained in {train_seconds:.0f} s; saved to {args.out_dir} ({size / 1e6:.2f} MB)")

    reloaded = AutoModelForCausalLM.from_pretrained(args.out_dir)
    for prompt in SAMPLE_PROMPTS:
        sample = generate(reloaded, tokenizer, prompt, max_new_tokens=48)
        print(f"--- greedy sample for {prompt!r}:\n{sample}")


if __name__ == "__main__":
    main()
