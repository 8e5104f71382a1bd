"""Whisper's audio encoder front-end (Radford et al., 2022, sec. 2.2), the source side of encoder_input "features".

    stem = AudioStem(config)                 # conv1, conv2, pe [source_positions, d_model]
    x = stem(features)                       # [B, n_mels, 2 * S] -> [B, S, d_model], the encoder stack's input
"""

from __future__ import annotations

import math

import torch
from torch import nn

from toolkit.reference.config import ModelConfig
def whisper_sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] Whisper's encoder positions: sines | cosines, timescales spaced log(max)/(channels/2 - 1)
    (float32, as Whisper computes them)."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2))
    scaled = torch.arange(length).view(-1, 1) * inv_timescales.view(1, -1)
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class AudioStem(nn.Module):
    """Whisper's encoder front-end (Radford et al., 2022, sec. 2.2): log-mel features through two Conv1d of kernel
    3 (the second of stride 2) with exact GELU after each, plus the positions table, in place of embeddings."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.n_mels, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.pe = nn.Parameter(whisper_sinusoids(config.source_positions, d))   # stored: the checkpoint's own
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(self.conv1(features))         # [B, n_mels, F] -> [B, D, F]
        x = nn.functional.gelu(self.conv2(x)).transpose(1, 2)  # -> [B, D, F/2] -> [B, S, D]
        return self.dropout(x + self.pe[: x.shape[1]])

