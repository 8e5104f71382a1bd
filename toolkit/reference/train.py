"""A small training loop: teacher forcing, label-smoothed cross entropy, Adam with the paper's warmup schedule (5.3)."""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from runtime.generate import pad_batch
from toolkit.reference.model import Transformer

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # src_ids [B, S], src_mask [B, S], tgt_ids [B, T] (BOS ... EOS)


def noam_lr(step: int, d_model: int, warmup: int, scale: float) -> float:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (eq. 3)."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def train_steps(model: Transformer, batches: Iterator[Batch], steps: int, *, warmup: int = 200, lr_scale: float = 1.0,
                label_smoothing: float = 0.1, seed: int = 0,
                on_step: Callable[[int, float], None] | None = None) -> float:
    """Train `steps` updates; returns the last loss. `on_step(step, loss)` reports progress."""
    torch.manual_seed(seed)
    pad = model.config.pad_id
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: noam_lr(s + 1, model.config.d_model, warmup, lr_scale))
    model.train()
    loss_value = math.nan
    for step in range(1, steps + 1):
        src, src_mask, tgt = next(batches)
        logits = model(src, src_mask, tgt[:, :-1])                                   # predict token t+1 from <= t
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1),
                               ignore_index=pad, label_smoothing=label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        if on_step is not None:
            on_step(step, loss_value)
    model.eval()
    return loss_value


def pad_targets(seqs: list[list[int]], pad: int) -> torch.Tensor:
    return torch.from_numpy(pad_batch(seqs, pad)[0])
