"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017), built for export.

Read top to bottom in the paper's order: embeddings and positions (3.4, 3.5), attention (3.2),
feed-forward (3.3), the residual sublayer (5.4), encoder and decoder layers and stacks (3.1),
the generator (3.4), and the model, whose `encode` runs once and whose `decode_step` takes and
returns an explicit KV cache:

    memory, cross_kv = model.encode(src_ids, src_mask)           # cross-attention K/V projected once
    logits, self_kv = model.decode_step(tgt_ids, src_mask, self_kv, cross_kv)   # self K/V grow by new_len

T5's variants (RMSNorm, the bucketed relative position bias, the gated feed-forward, unscaled scores, no biases,
the rescaled tied head) are ModelConfig fields; the bias itself lives in toolkit/reference/relative.py. Whisper's
audio encoder (encoder_input "features": AudioStem in place of the source embeddings, no encoder mask) is one too:
its `encode` takes log-mel features [B, n_mels, frames], and its decoder is given an all-ones source mask.

Shapes: B batch, S source length, T new target tokens, P past length, H heads, Dh head dim.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from toolkit.reference.config import ModelConfig
from toolkit.reference.audio_stem import AudioStem, whisper_sinusoids
from toolkit.reference.relative import RelativePositionBias, bucket_table

KV = tuple[torch.Tensor, torch.Tensor]  # (key, value), each [B, H, len, Dh]


class Embeddings(nn.Module):
    """Token embeddings scaled by sqrt(d_model) (sec. 3.4; scale 1 as an option)."""

    def __init__(self, config: ModelConfig, vocab_size: int | None = None):
        super().__init__()
        self.lut = nn.Embedding(vocab_size or config.vocab_size, config.d_model)
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lut(ids) * self.scale  # [B, T] -> [B, T, D]


def sinusoid_table(config: ModelConfig) -> torch.Tensor:
    """[max_len, d_model] positions. "interleaved" (sec. 3.5): PE(pos, 2i) = sin(pos / 10000^(2i/d)),
    PE(pos, 2i+1) = cos(...). "halves" (Marian): the sines in the first half, the cosines in the second, computed in
    float64 as Marian does, so that imported models see the very same table."""
    n, d = config.max_len, config.d_model
    if config.positions == "halves":
        angle = np.arange(n, dtype=np.float64)[:, None] / np.power(10000, 2 * (np.arange(d) // 2) / d)[None, :]
        half = d // 2 + d % 2
        pe = torch.empty(n, d)
        pe[:, :half] = torch.FloatTensor(np.sin(angle[:, 0::2]))
        pe[:, half:] = torch.FloatTensor(np.cos(angle[:, 1::2]))
        return pe
    pos = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div[: d // 2])
    return pe


class PositionalEncoding(nn.Module):
    """Positions added to the embeddings (sec. 3.5): the sinusoid table the config names, or a table stored in the
    checkpoint (positions "table"); then the embedding LayerNorm where the config has one (BART), then dropout."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.positions == "table":
            self.pe = nn.Parameter(torch.zeros(config.max_len, config.d_model))   # learned or imported, stored
        elif config.positions == "none":
            self.pe = None                                 # T5: word order comes from the relative position bias
        else:
            self.register_buffer("pe", sinusoid_table(config), persistent=False)  # derived, never stored in checkpoints
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.layernorm_embedding \
            else nn.Identity()
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, start: int | torch.Tensor = 0,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """positions [B, T]: each token's own position (rows at different positions); default start + 0..T-1."""
        if self.pe is None:
            return self.dropout(self.norm(x))
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device) + start  # [T], starting at the past length
        return self.dropout(self.norm(x + self.pe[positions]))


def per_side_positions(config: ModelConfig) -> bool:
    """Whether source and target have their own PositionalEncoding (tables or embedding LayerNorms of their own);
    an audio encoder's positions are its stem's (AudioStem)."""
    return (config.positions == "table" or config.layernorm_embedding) and not config.features


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..h) W^O, head_i = softmax(Q_i K_i^T / sqrt(d_k)) V_i (sec. 3.2); T5: the
    scores unscaled, plus a relative position bias, and no projection biases."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.h, self.d_k = config.n_heads, config.head_dim
        d, inner, bias = config.d_model, config.inner_dim, config.linear_bias
        self.q_proj = nn.Linear(d, inner, bias=bias)
        self.k_proj = nn.Linear(d, inner, bias=bias and config.key_bias)     # Whisper: no key bias
        self.v_proj = nn.Linear(d, inner, bias=bias)
        self.out_proj = nn.Linear(inner, d, bias=bias)
        self.scaled = config.attention_scale
        self.dropout = nn.Dropout(config.dropout)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.h, self.d_k).transpose(1, 2)  # [B, T, D] -> [B, H, T, Dh]

    def project_kv(self, x: torch.Tensor) -> KV:
        """Keys and values of x, split into heads: computed once for cross-attention."""
        return self.split(self.k_proj(x)), self.split(self.v_proj(x))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """Scaled dot-product attention (eq. 1); mask is True where a query may attend (None: every key, Whisper's
        encoder); bias [B|1, H, Tq, Tk] is added to the scores (T5's relative position bias)."""
        scores = q @ k.transpose(-2, -1)  # [B, H, Tq, Tk]
        if self.scaled:
            scores = scores / math.sqrt(self.d_k)
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = self.dropout(torch.softmax(scores, dim=-1))
        out = weights @ v  # [B, H, Tq, Dh]
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.h * self.d_k))  # -> [B, Tq, D]

    def forward(self, x: torch.Tensor, mask: torch.Tensor, past: KV | None = None,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
        """Self-attention over x; with `past`, the new keys/values are appended to it and returned."""
        q = self.split(self.q_proj(x))
        k, v = self.project_kv(x)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # [B, H, P+T, Dh]
        return self.attend(q, k, v, mask, bias), (k, v)


ACTIVATION_MODULES = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU,
                      "gelu_tanh": lambda: nn.GELU(approximate="tanh")}   # T5's gelu_new


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, position-wise (sec. 3.3); GELU, tanh-GELU or SiLU (swish) as options;
    gated (T5 v1.1): (act(x W1) * x W3) W2."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        bias = config.linear_bias
        self.w_1 = nn.Linear(config.d_model, config.d_ff, bias=bias)
        self.w_3 = nn.Linear(config.d_model, config.d_ff, bias=bias) if config.gated_ffn else None
        self.w_2 = nn.Linear(config.d_ff, config.d_model, bias=bias)
        self.act = ACTIVATION_MODULES[config.activation]()
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.w_1(x))                                  # [B, T, D] -> [B, T, d_ff]
        if self.w_3 is not None:
            hidden = hidden * self.w_3(x)                               # the gate's linear half
        return self.w_2(self.dropout(hidden))


class RMSNorm(nn.Module):
    """RMSNorm (Zhang and Sennrich, 2019) as T5 computes it: x / sqrt(mean(x^2) + eps) times a gain, no mean and no
    bias, the variance in float32."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)   # [B, T, 1]
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def layer_norm(config: ModelConfig) -> nn.Module:
    """The normalization the config names: LayerNorm (paper) or RMSNorm (T5)."""
    if config.normalization == "rms":
        return RMSNorm(config.d_model, config.layer_norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)


class Sublayer(nn.Module):
    """Residual connection around a sublayer with LayerNorm: post-norm LN(x + f(x)) or pre-norm x + f(LN(x)) (5.4)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = layer_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        self.pre = config.norm == "pre"

    def forward(self, x: torch.Tensor, fn):
        """fn maps the (normed) input to (output, extra); returns (new x, extra)."""
        if self.pre:
            out, extra = fn(self.norm(x))
            return x + self.dropout(out), extra
        out, extra = fn(x)
        return self.norm(x + self.dropout(out)), extra


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in a residual sublayer (sec. 3.1, encoder)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(config)
        self.ffn = FeedForward(config)
        self.sublayers = nn.ModuleList([Sublayer(config), Sublayer(config)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x, _ = self.sublayers[0](x, lambda y: self.self_attn(y, mask, bias=bias))
        x, _ = self.sublayers[1](x, lambda y: (self.ffn(y), None))
        return x


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder output, feed-forward (sec. 3.1, decoder)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(config)
        self.cross_attn = MultiHeadAttention(config)
        self.ffn = FeedForward(config)
        self.sublayers = nn.ModuleList([Sublayer(config) for _ in range(3)])

    def forward(self, x, self_mask, cross_mask, past: KV, cross: KV, bias=None) -> tuple[torch.Tensor, KV]:
        x, present = self.sublayers[0](x, lambda y: self.self_attn(y, self_mask, past, bias))
        x, _ = self.sublayers[1](
            x, lambda y: (self.cross_attn.attend(self.cross_attn.split(self.cross_attn.q_proj(y)), *cross, cross_mask), None))
        x, _ = self.sublayers[2](x, lambda y: (self.ffn(y), None))
        return x, present


def stack_norm(config: ModelConfig) -> nn.Module:
    """The LayerNorm after a stack: always in pre-norm models, in post-norm ones with final_norm (nn.Transformer)."""
    if config.norm == "pre" or config.final_norm:
        return layer_norm(config)
    return nn.Identity()


class Encoder(nn.Module):
    """A stack of N encoder layers (plus a final LayerNorm in pre-norm models and with final_norm)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_encoder_layers)])
        self.norm = stack_norm(config)
        if config.relative_buckets:                  # T5: one bidirectional table, added in every layer
            self.relative_bias = RelativePositionBias(config, bidirectional=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = None
        if hasattr(self, "relative_bias"):
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)          # [1, S]: query = key positions
            bias = self.relative_bias(pos, pos)                                     # [1, H, S, S], once per stack
        for layer in self.layers:
            x = layer(x, mask, bias)
        return self.norm(x)


class Decoder(nn.Module):
    """A stack of N decoder layers (plus a final LayerNorm in pre-norm models and with final_norm)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_decoder_layers)])
        self.norm = stack_norm(config)
        if config.relative_buckets:                  # T5: one one-way table, added in every layer
            self.relative_bias = RelativePositionBias(config, bidirectional=False)

    def forward(self, x, self_mask, cross_mask, past: list[KV], cross: list[KV],
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """bias [B|1, H, T, P+T]: the self-attention's relative position bias (Transformer.decode_step)."""
        presents = []
        for layer, layer_past, layer_cross in zip(self.layers, past, cross):
            x, present = layer(x, self_mask, cross_mask, layer_past, layer_cross, bias)
            presents.append(present)
        return self.norm(x), presents


class Generator(nn.Module):
    """Linear projection to vocabulary logits, optionally tied to the target embeddings (sec. 3.4), optionally
    with a bias (Marian's final_logits_bias, the bias of the tutorial's generator Linear)."""

    def __init__(self, config: ModelConfig, embeddings: Embeddings):
        super().__init__()
        self.tied = config.tie_embeddings
        self.embeddings = [embeddings]  # a list, so the tied weight is not registered twice
        if not self.tied:
            self.proj = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size)) if config.logits_bias else None
        self.rescale = config.d_model ** -0.5 if config.head_rescale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rescale is not None:
            x = x * self.rescale                     # T5's tied head: the decoder output times d_model**-0.5
        weight = self.embeddings[0].lut.weight if self.tied else self.proj.weight
        logits = x @ weight.t()  # [B, T, D] -> [B, T, V] (logits, before softmax)
        return logits if self.bias is None else logits + self.bias


def causal_mask(new_len: int, past_len: int | torch.Tensor, device=None) -> torch.Tensor:
    """[1, 1, T, P+T] boolean: query i (at position past_len + i) may see keys 0..past_len + i."""
    q_pos = torch.arange(new_len, device=device) + past_len
    k_pos = torch.arange(new_len + past_len, device=device)
    return (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).unsqueeze(0).unsqueeze(0)


class Transformer(nn.Module):
    """The encoder-decoder model, with `encode` kept apart from the cached `decode_step`."""

    def __init__(self, config: ModelConfig, seed: int | None = 0):
        super().__init__()
        self.config = config
        self.embed = Embeddings(config)  # the target's; also the source's when shared, and the output matrix when tied
        if config.features:
            self.audio = AudioStem(config)  # Whisper: the encoder reads log-mel features
        elif not config.share_embeddings:
            self.src_embed = Embeddings(config, config.source_vocab_size)
        self.pos = PositionalEncoding(config)  # the target's; also the source's unless per_side_positions
        if per_side_positions(config):
            self.src_pos = PositionalEncoding(config)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.generator = Generator(config, self.embed)
        if not self.embed.lut.weight.is_meta:            # empty(): no weights to draw
            self.init_weights(seed)

    @classmethod
    def empty(cls, config: ModelConfig) -> "Transformer":
        """The model's structure with no weights behind it (meta tensors: shapes and names only), for checking a
        state dict against the config and for from_state."""
        with torch.device("meta"):
            return cls(config)

    @classmethod
    def from_state(cls, config: ModelConfig, state: dict[str, torch.Tensor]) -> "Transformer":
        """The model holding STATE's tensors themselves (made float32 and contiguous; a copy only where they were
        not), in eval mode, without drawing random weights first. So a model of N GB is held once, not twice, and
        tensors mapped from a safetensors file stay file pages (which the kernel can drop) until written to: what
        lets import and export of the largest models fit in memory. STATE must match the config (callers check it
        with empty().state_dict() first, for their own messages)."""
        model = cls.empty(config)
        model.load_state_dict({k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}, assign=True)
        for module in model.modules():                  # derived buffers (sinusoid and bucket tables) are not in
            if isinstance(module, PositionalEncoding) and module.pe is not None and module.pe.is_meta:   # a state
                module.pe = sinusoid_table(config)
            if isinstance(module, RelativePositionBias) and module.buckets.is_meta:
                module.buckets = bucket_table(config, module.bidirectional)
        left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"from_state: no tensor for {', '.join(left[:4])}")
        return model.eval()

    def init_weights(self, seed: int | None) -> None:
        """Xavier-uniform matrices and zero biases, drawn from a private generator seeded by `seed`."""
        gen = torch.Generator().manual_seed(0 if seed is None else seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() > 1:
                    bound = math.sqrt(6.0 / (p.shape[0] + p.shape[1]))
                    p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
                elif name.endswith("bias"):
                    p.zero_()
            # the embedding is also the (tied) output matrix: N(0, d^-1/2) keeps logits O(1) (as in the paper's setup)
            for embed in dict.fromkeys((self.embed, self.source_embed)):
                embed.lut.weight.copy_(torch.randn(embed.lut.weight.shape, generator=gen) * self.config.d_model ** -0.5)
            if self.config.features:                     # the positions are sinusoids, not random matrices
                self.audio.pe.copy_(whisper_sinusoids(*self.audio.pe.shape))

    @property
    def source_embed(self) -> Embeddings:
        """The source side's token embeddings (the target's when they are shared)."""
        return self.embed if self.config.share_embeddings else self.src_embed

    @property
    def source_pos(self) -> PositionalEncoding:
        """The source side's positions (the target's module unless each side has its own)."""
        return self.src_pos if per_side_positions(self.config) else self.pos

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor | None) -> tuple[torch.Tensor, list[KV]]:
        """Encoder output [B, S, D] and each decoder layer's cross-attention K/V [B, H, S, Dh]. An audio encoder
        (config.features) takes features [B, n_mels, frames] as src_ids and no mask (src_mask is ignored)."""
        if self.config.features:
            memory = self.encoder(self.audio(src_ids), None)
        else:
            mask = src_mask.bool()[:, None, None, :]  # [B, 1, 1, S]: keys that are real tokens
            memory = self.encoder(self.source_pos(self.source_embed(src_ids)), mask)
        cross = [layer.cross_attn.project_kv(memory) for layer in self.decoder.layers]
        return memory, cross

    def decode_step(self, tgt_ids: torch.Tensor, src_mask: torch.Tensor, past: list[KV], cross: list[KV],
                    position_ids: torch.Tensor | None = None,
                    past_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """Logits [B, T, V] for T new tokens, and the self-attention caches grown to [B, H, P+T, Dh].

        Rows at different positions (in-flight batching): position_ids [B, T] gives each new token's position in
        its own sequence (default P + 0..T-1), past_mask [B, P] is 1 where a cached key is a real token of that row
        (default all); the new tokens are always attended, causally."""
        past_len = past[0][0].shape[2]
        x = self.pos(self.embed(tgt_ids), start=past_len, positions=position_ids)
        self_mask = causal_mask(tgt_ids.shape[1], past_len, tgt_ids.device)
        keys = None
        if past_mask is not None:
            keys = torch.cat([past_mask.bool(), torch.ones_like(tgt_ids, dtype=torch.bool)], dim=1)  # [B, P+T]
            self_mask = self_mask & keys[:, None, None, :]                                              # [B, 1, T, P+T]
        cross_mask = src_mask.bool()[:, None, None, :]
        bias = self.decoder_bias(tgt_ids, past_len, position_ids, keys)
        x, presents = self.decoder(x, self_mask, cross_mask, past, cross, bias)
        return self.generator(x), presents

    def decoder_bias(self, tgt_ids: torch.Tensor, past_len: int, position_ids: torch.Tensor | None,
                     keys: torch.Tensor | None) -> torch.Tensor | None:
        """The decoder's relative position bias [B|1, H, T, P+T], once per step for every layer (None without one).
        A query's position is its position_ids (default P + 0..T-1, the cache's length); a key's is its slot, or,
        where a key mask says which slots are real (rows at different positions), the real keys before it."""
        if not hasattr(self.decoder, "relative_bias"):
            return None
        new_len = tgt_ids.shape[1]
        if position_ids is None:
            position_ids = (torch.arange(new_len, device=tgt_ids.device) + past_len).unsqueeze(0)   # [1, T]
        if keys is None:
            key_pos = torch.arange(past_len + new_len, device=tgt_ids.device).unsqueeze(0)           # [1, P+T]
        else:
            key_pos = torch.cumsum(keys.long(), dim=1) - 1                                             # [B, P+T]
        return self.decoder.relative_bias(position_ids, key_pos)

    def empty_cache(self, batch: int, device=None, dtype=torch.float32) -> list[KV]:
        """A zero-length self-attention cache for the first decoder step."""
        c = self.config
        empty = torch.zeros(batch, c.n_heads, 0, c.head_dim, device=device, dtype=dtype)
        return [(empty, empty) for _ in range(c.n_decoder_layers)]

    def forward(self, src_ids: torch.Tensor, src_mask: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [B, T, V] for training: the first decode step with no past."""
        _, cross = self.encode(src_ids, src_mask)
        logits, _ = self.decode_step(tgt_ids, src_mask, self.empty_cache(src_ids.shape[0], src_ids.device), cross)
        return logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
