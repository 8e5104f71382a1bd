"""PyTorch engines for runtime.search: eager with an explicit KV cache, and eager recomputing the prefix.

Both feed the same numpy search as the ONNX Runtime engine, so token choices are made by one piece
of code and parity compares only numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.spec import (begin_suppressed_ids, feature_shape, forces_eos, source_pad_id, source_vocab_size,
                          suppressed_ids)
from toolkit.reference.model import KV, Transformer


class TorchState:
    """Decoder state of one request: caches live as torch tensors between steps."""

    def __init__(self, model: Transformer, src_mask: torch.Tensor, cross: list[KV], use_cache: bool):
        self.model, self.src_mask, self.cross, self.use_cache = model, src_mask, cross, use_cache
        self.rows = np.arange(src_mask.shape[0])         # source row of each current row
        self.past = model.empty_cache(src_mask.shape[0], src_mask.device, cross[0][0].dtype)
        self.prefix = torch.zeros(src_mask.shape[0], 0, dtype=torch.long, device=src_mask.device)

    @torch.no_grad()
    def step(self, tokens: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
        if keep is not None:
            keep = np.asarray(keep, dtype=np.int64)
            idx = torch.from_numpy(keep).to(self.src_mask.device)
            self.past = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.past]
            if not self.use_cache:
                self.prefix = self.prefix.index_select(0, idx)
            new_rows = self.rows[keep]
            if not np.array_equal(new_rows, self.rows):   # rows changed source: cross K/V and mask move too
                self.cross = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.cross]
                self.src_mask = self.src_mask.index_select(0, idx)
            self.rows = new_rows
        return self.feed(np.asarray(tokens, dtype=np.int64)[:, None])[:, -1]   # [N, V]

    @torch.no_grad()
    def feed(self, tokens: np.ndarray) -> np.ndarray:
        """T given tokens per row [N, T] -> logits [N, T, V] (teacher forcing; the cache grows by T)."""
        new = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)).to(self.src_mask.device)
        if self.use_cache:
            logits, self.past = self.model.decode_step(new, self.src_mask, self.past, self.cross)
        else:  # recompute the whole prefix every step (the uncached baseline); self.past stays empty
            self.prefix = torch.cat([self.prefix, new], dim=1)
            logits, _ = self.model.decode_step(self.prefix, self.src_mask, self.past, self.cross)
        return logits[:, -new.shape[1]:].float().cpu().numpy()


class TorchEngine:
    """runtime.generate.Engine over a PyTorch Transformer (CPU or CUDA)."""

    def __init__(self, model: Transformer, use_cache: bool = True, device: str = "cpu"):
        self.model = model.eval().to(device)
        self.device, self.use_cache = device, use_cache
        c = model.config
        self.pad_id, self.bos_id, self.eos_id = c.pad_id, c.bos_id, c.eos_id
        self.vocab_size, self.max_len = c.vocab_size, c.max_len
        config = c.to_dict()
        self.src_vocab_size, self.suppress_ids = source_vocab_size(config), suppressed_ids(config)
        self.src_pad_id, self.forced_eos = source_pad_id(config), forces_eos(config)
        self.feature_shape, self.begin_suppress_ids = feature_shape(config), begin_suppressed_ids(config)
        self.name = "torch-cache" if use_cache else "torch-nocache"

    @torch.no_grad()
    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list:
        """The encoder's run alone: the cross K/V pairs that start(encoded=) takes (runtime.ort_engine's encode)."""
        ids = torch.from_numpy(np.ascontiguousarray(input_ids)).to(self.device)
        mask = torch.from_numpy(np.ascontiguousarray(attention_mask)).to(self.device)
        return list(self.model.encode(ids, mask)[1])

    @torch.no_grad()
    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, expand: int,
              max_steps: int | None = None, encoded: list | None = None) -> TorchState:
        """input_ids: token ids [B, S], or an audio encoder's features [B, n_mels, frames] (runtime.generate).
        `encoded`: encode(input_ids, attention_mask) already run (the encoder is then skipped)."""
        ids = torch.from_numpy(np.ascontiguousarray(input_ids)).to(self.device)
        mask = torch.from_numpy(np.ascontiguousarray(attention_mask)).to(self.device)
        cross = self.model.encode(ids, mask)[1] if encoded is None else list(encoded)
        if expand > 1:                                    # beam rows b * expand + j share input b
            mask = mask.repeat_interleave(expand, dim=0)
            cross = [(k.repeat_interleave(expand, 0), v.repeat_interleave(expand, 0)) for k, v in cross]
        return TorchState(self.model, mask, cross, self.use_cache)
