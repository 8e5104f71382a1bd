"""The model configuration: one frozen dataclass, its presets, and its JSON form."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import read_json
from toolkit.reference.errors import ConfigError


ACTIVATIONS = ("relu", "gelu", "silu", "gelu_tanh")
POSITIONS = ("interleaved", "halves", "table", "none")
ENCODER_INPUTS = ("tokens", "features")
TOKEN_LISTS = ("suppress_tokens", "begin_suppress_tokens")     # tuples of ids (JSON lists in config.json)
NORMALIZATIONS = ("layernorm", "rms")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and choices of the encoder-decoder Transformer ("Attention Is All You Need", sec. 3)."""

    vocab_size: int = 8000          # shared source/target vocabulary (the paper shares one BPE vocab)
    d_model: int = 512              # model width, d_model in the paper
    n_heads: int = 8                # attention heads h; d_k = d_v = d_model / h
    n_encoder_layers: int = 6       # N encoder layers
    n_decoder_layers: int = 6       # N decoder layers
    d_ff: int = 2048                # inner size of the position-wise feed-forward network
    max_len: int = 256              # longest source and longest target (positional table size)
    dropout: float = 0.1            # P_drop, applied only in training
    norm: str = "post"              # "post": LayerNorm(x + sublayer(x)) as in the paper; "pre": x + sublayer(LayerNorm(x))
    activation: str = "relu"        # FFN non-linearity: "relu" (paper), "gelu" (exact erf) or "silu" (x * sigmoid(x), Marian's swish)
    tie_embeddings: bool = True     # output projection shares the target embedding matrix (sec. 3.4)
    layer_norm_eps: float = 1e-5    # LayerNorm epsilon
    pad_id: int = 0                 # padding token
    bos_id: int = 1                 # decoder start token (Marian starts from pad: bos_id == pad_id; BART from eos)
    eos_id: int = 2                 # end of sequence
    # variants of real checkpoints (importers set them; the defaults are the paper's choices)
    positions: str = "interleaved"  # sinusoid table: "interleaved" sin/cos (paper) or "halves": sin | cos (Marian);
                                    # "table": a [max_len, d_model] table per side stored in the checkpoint (BART's
                                    # learned positions, M2M100's fairseq sinusoids; importers drop their offset rows)
    scale_embeddings: bool = True   # token embeddings times sqrt(d_model) (paper); False: times 1
    logits_bias: bool = False       # a bias added to the logits (Marian's final_logits_bias, a tutorial Linear's bias)
    src_vocab_size: int | None = None   # source vocabulary size when it differs from the target's (None: shared)
    share_embeddings: bool = True   # source and target token embeddings are one matrix (needs one vocabulary size)
    final_norm: bool = False        # a LayerNorm after the post-norm encoder and decoder stacks (torch.nn.Transformer)
    suppress_pad: bool = False      # never generate pad (Marian: its bad_words_ids are [[pad]])
    layernorm_embedding: bool = False   # a LayerNorm per side on embeddings + positions (BART, mBART)
    forced_eos: bool = False        # a target that reaches the length limit ends with EOS there (transformers'
                                    # forced_eos_token_id: BART, mBART, Pegasus, Marian); a default of the search
    # T5's variants (Raffel et al., 2020): positions "none" with relative_buckets > 0, normalization "rms",
    # attention_scale false, linear_bias false, gated_ffn with "gelu_tanh" (v1.1) or "relu" (the original), d_kv
    d_kv: int | None = None         # per-head size d_k = d_v; None: d_model / n_heads (paper); T5's d_kv may differ
    attention_scale: bool = True    # scores divided by sqrt(d_k) (eq. 1); False: unscaled (T5 folds it into its init)
    linear_bias: bool = True        # biases in the attention and feed-forward projections (paper); False: none (T5)
    normalization: str = "layernorm"    # "layernorm" (paper); "rms": RMSNorm, a gain without bias or mean, its
                                        # variance in float32 (T5's T5LayerNorm)
    gated_ffn: bool = False         # FFN(x) = (act(x W1) * x W3) W2 (T5 v1.1's gated-GELU); False: act(x W1) W2
    relative_buckets: int = 0       # 0: no relative position bias (paper); > 0: T5's bucketed bias with this many
                                    # buckets, one table per stack (bidirectional in the encoder, one-way in the
                                    # decoder) added to the scores of every self-attention layer
    relative_max_distance: int = 128    # distances from here on share T5's last (logarithmic) bucket
    head_rescale: bool = False      # the decoder output times d_model**-0.5 before the output projection (T5's
                                    # tied head); False: as is (paper)
    # Whisper's variants (Radford et al., 2022): an audio encoder over log-mel features, no key bias, suppressed ids
    encoder_input: str = "tokens"   # "tokens": token ids and embeddings (paper); "features": log-mel features
                                    # [B, n_mels, 2 * source_positions] through two Conv1d (kernel 3; stride 1, then
                                    # 2), each followed by exact GELU, plus a [source_positions, d_model] table
                                    # (Whisper's sinusoids, stored in the checkpoint); the encoder has no mask
    n_mels: int = 80                # "features": mel bins of the input (Whisper: 80; large-v3: 128)
    source_positions: int = 1500    # "features": encoder positions, half the input frames (30 s at 100 frames/s)
    key_bias: bool = True           # the attention key projection has a bias (with linear_bias); Whisper's has none
    suppress_tokens: tuple[int, ...] = ()        # never generated (Whisper's generation_config suppress_tokens)
    begin_suppress_tokens: tuple[int, ...] = ()  # not generated as the first token after the forced prefix (Whisper:
                                                 # the space and the end token)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads if self.d_kv is None else self.d_kv

    @property
    def inner_dim(self) -> int:
        """Width of the attention heads together, n_heads * d_k (d_model unless d_kv says otherwise)."""
        return self.n_heads * self.head_dim

    def validate(self) -> None:
        """Reject sizes the model cannot be built with, naming the fix."""
        ints = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.type in ("int", int)}
        for name, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
        for name in ("vocab_size", "d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff", "max_len"):
            if ints[name] < 1:
                raise ConfigError(f"config field {name!r} must be at least 1, got {ints[name]}")
        if self.d_kv is not None and (not isinstance(self.d_kv, int) or isinstance(self.d_kv, bool) or self.d_kv < 1):
            raise ConfigError(f"d_kv must be a positive integer or null, got {self.d_kv!r}")
        if self.d_kv is None and self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model ({self.d_model}) is not divisible by n_heads ({self.n_heads}); "
                f"choose a head count that divides d_model")
        if self.norm not in ("post", "pre"):
            raise ConfigError(f"norm must be 'post' or 'pre', got {self.norm!r}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.positions not in POSITIONS:
            raise ConfigError(f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.normalization!r}")
        self.validate_relative()
        self.validate_features()
        for name in ("tie_embeddings", "scale_embeddings", "logits_bias", "share_embeddings", "final_norm",
                     "suppress_pad", "layernorm_embedding", "forced_eos", "attention_scale", "linear_bias",
                     "gated_ffn", "head_rescale", "key_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field {name!r} must be true or false, got {getattr(self, name)!r}")
        if self.src_vocab_size is not None and (not isinstance(self.src_vocab_size, int) or self.src_vocab_size < 1):
            raise ConfigError(f"src_vocab_size must be a positive integer or null, got {self.src_vocab_size!r}")
        if self.share_embeddings and self.source_vocab_size != self.vocab_size:
            raise ConfigError(f"shared source/target embeddings need one vocabulary size, got src_vocab_size "
                              f"{self.src_vocab_size} and vocab_size {self.vocab_size}; set share_embeddings false")
        if self.final_norm and self.norm == "pre":
            raise ConfigError("final_norm is for post-norm stacks (pre-norm stacks always end with a LayerNorm); "
                              "set norm 'post' or final_norm false")
        for name in ("dropout", "layer_norm_eps"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field {name!r} must be a number, got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not 0.0 < self.layer_norm_eps < 1.0:
            raise ConfigError(f"layer_norm_eps must be in (0, 1), got {self.layer_norm_eps!r}")
        for name in ("pad_id", "bos_id", "eos_id"):
            if not 0 <= ints[name] < self.vocab_size:
                raise ConfigError(f"{name} ({ints[name]}) must lie inside the vocabulary [0, {self.vocab_size})")
        if self.eos_id == self.pad_id and self.encoder_input == "tokens":     # Whisper pads nothing: pad may be eos
            raise ConfigError("eos_id must differ from pad_id")
        for name in TOKEN_LISTS:
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                     and 0 <= i < self.vocab_size for i in ids):
                raise ConfigError(f"{name} must be a list of token ids inside the vocabulary [0, {self.vocab_size}), "
                                  f"got {ids!r}")

    def validate_relative(self) -> None:
        """The relative position bias: buckets, distance, and a source of positions (absolute or relative)."""
        if self.relative_buckets < 0 or self.relative_buckets == 1:
            raise ConfigError(f"relative_buckets must be 0 (none) or at least 2, got {self.relative_buckets}")
        if self.relative_buckets and self.relative_max_distance < 2:
            raise ConfigError(f"relative_max_distance must be at least 2, got {self.relative_max_distance}")
        if self.positions == "none" and not self.relative_buckets:
            raise ConfigError("positions 'none' needs a relative position bias (relative_buckets > 0): "
                              "the model would not see word order")

    def validate_features(self) -> None:
        """The audio encoder's input: a known kind, and for features positive sizes."""
        if self.encoder_input not in ENCODER_INPUTS:
            raise ConfigError(f"encoder_input must be one of {', '.join(ENCODER_INPUTS)}, got {self.encoder_input!r}")
        for name in ("n_mels", "source_positions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config field {name!r} must be at least 1, got {getattr(self, name)}")

    @property
    def features(self) -> bool:
        """Whether the encoder reads log-mel features (Whisper) rather than token ids."""
        return self.encoder_input == "features"

    @property
    def source_vocab_size(self) -> int:
        """Size of the source vocabulary (the target's when they are shared)."""
        return self.vocab_size if self.src_vocab_size is None else self.src_vocab_size

    def to_dict(self) -> dict:
        """The config as JSON keeps it (id tuples as lists), so that it equals a stored one."""
        return {k: list(v) if k in TOKEN_LISTS else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError("config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
        data = {k: tuple(v) if k in TOKEN_LISTS and isinstance(v, list) else v for k, v in data.items()}
        try:
            return cls(**data)
        except TypeError as exc:  # pragma: no cover - defensive
            raise ConfigError(f"bad config: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(read_json(path, ConfigError, "fix or regenerate it",
                                       missing="a checkpoint directory needs a config.json"))


PRESETS: dict[str, ModelConfig] = {
    # a few thousand parameters: unit and parity tests
    "tiny": ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                        d_ff=64, max_len=64),
    # a small seq2seq model: the dates example and quick benchmarks
    "small": ModelConfig(vocab_size=1000, d_model=256, n_heads=4, n_encoder_layers=3, n_decoder_layers=3,
                         d_ff=1024, max_len=128),
    # the paper's base model (Table 3, row "base")
    "base": ModelConfig(),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset, with any field overridden (None values are ignored)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(PRESETS[name], **changes)
