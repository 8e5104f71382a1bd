"""T5's relative position bias (Raffel et al., 2020, sec. 2.1; Shaw et al., 2018): a learned scalar per head and
bucket of the distance between key and query, added to the attention scores of every self-attention layer.

    bias = RelativePositionBias(config, bidirectional=True)      # the encoder's; the decoder's is one-way
    scores += bias(query_positions, key_positions)               # [B|1, Tq] x [B|1, Tk] -> [B|1, H, Tq, Tk]

Distances below half the buckets (a quarter, bidirectionally) have a bucket each; longer ones share buckets spaced
logarithmically up to relative_max_distance, past which all share the last. Bidirectional (the encoder): keys after
the query have buckets of their own; one-way (the decoder): every later key shares distance 0's bucket (the causal
mask hides them anyway). The bucket of every distance a model of max_len positions meets is a table computed once
(a buffer derived from the config, never stored), with transformers' own float32 arithmetic, so that a traced
graph gathers the very buckets T5 computes instead of recomputing a logarithm that could round differently.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from toolkit.reference.config import ModelConfig


def relative_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """The bucket of each relative position (key position - query position), as T5 (mesh-tensorflow) computes it."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).to(torch.long) * num_buckets     # later keys: the upper half
        distance = torch.abs(relative)
    else:
        distance = -torch.min(relative, torch.zeros_like(relative))          # later keys: distance 0
    exact = num_buckets // 2                                                 # one bucket per distance below this
    is_small = distance < exact
    large = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, distance, large)


def bucket_table(config: ModelConfig, bidirectional: bool) -> torch.Tensor:
    """[2 * max_len - 1] int64: the bucket of relative position r = k - q at index r + max_len - 1."""
    relative = torch.arange(-(config.max_len - 1), config.max_len, dtype=torch.long)
    return relative_bucket(relative, bidirectional, config.relative_buckets, config.relative_max_distance)


class RelativePositionBias(nn.Module):
    """One stack's relative position bias: embedding[bucket(k - q)] per head (T5's relative_attention_bias)."""

    def __init__(self, config: ModelConfig, bidirectional: bool):
        super().__init__()
        self.bidirectional, self.max_len = bidirectional, config.max_len
        self.embedding = nn.Embedding(config.relative_buckets, config.n_heads)   # [buckets, H], stored
        self.register_buffer("buckets", bucket_table(config, bidirectional), persistent=False)  # derived

    def offset_table(self) -> torch.Tensor:
        """[2 * max_len - 1, H]: the bias of every offset k - q a model of max_len positions meets (row r + max_len
        - 1 for offset r). Made of weights and the derived buckets only, so export folds it into one table the
        bundle carries."""
        return self.embedding(self.buckets)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """q_pos [B|1, Tq], k_pos [B|1, Tk] (positions in 0..max_len-1) -> bias [B|1, H, Tq, Tk]: rows of the
        offset table, gathered once per call (a stack calls it once per step, for all its layers)."""
        relative = k_pos.unsqueeze(1) - q_pos.unsqueeze(2) + (self.max_len - 1)      # [B|1, Tq, Tk], index
        relative = relative.clamp(0, 2 * self.max_len - 2)
        values = self.offset_table()[relative]                                      # [B|1, Tq, Tk, H]
        return values.permute(0, 3, 1, 2)
