"""A toy task for tests: map a random id sequence to its reverse shifted by one id.

A tiny model learns it in a few hundred steps, so tests get a *trained* model whose outputs depend
on the input (random weights emit one token over and over, and token equality on them proves nothing).
"""

from __future__ import annotations

import numpy as np
import torch

from toolkit.reference.config import ModelConfig
from toolkit.reference.model import Transformer
from toolkit.reference.train import pad_targets, train_steps

FIRST = 3  # ids 0-2 are pad, bos, eos


def toy_target(src: list[int], vocab_size: int) -> list[int]:
    return [FIRST + (t - FIRST + 1) % (vocab_size - FIRST) for t in reversed(src)]


def toy_batches(config: ModelConfig, batch: int, min_len: int, max_len: int, seed: int):
    """Endless batches of (src, mask, BOS + target + EOS), with varied lengths and padding."""
    rng = np.random.default_rng(seed)
    while True:
        lens = rng.integers(min_len, max_len + 1, size=batch)
        srcs = [rng.integers(FIRST, config.source_vocab_size, size=n).tolist() for n in lens]
        tgts = [[config.bos_id] + toy_target(s, config.vocab_size) + [config.eos_id] for s in srcs]
        src = pad_targets(srcs, config.pad_id)
        yield src, (src != config.pad_id).long(), pad_targets(tgts, config.pad_id)


def toy_inputs(config: ModelConfig, n: int, min_len: int = 1, max_len: int = 12, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST, config.source_vocab_size, size=int(k)).tolist()
            for k in rng.integers(min_len, max_len + 1, size=n)]


def train_toy(config: ModelConfig, steps: int = 300, seed: int = 0, max_len: int = 12) -> Transformer:
    """A model trained on the toy task: its greedy outputs vary with the input."""
    torch.manual_seed(seed)
    model = Transformer(config, seed=seed)
    train_steps(model, toy_batches(config, 32, 1, max_len, seed), steps, warmup=100, lr_scale=0.5, seed=seed)
    return model.eval()
