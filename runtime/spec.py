"""The graph interfaces, written down once as plain data.

The exporter builds its wrappers and dynamic axes from these specs, the manifest records them,
and the runtime feeds the graphs by them. Nothing here imports torch or onnx.

Cache names follow one scheme (layer-indexed, as in Hugging Face Optimum):
    past_key_values.{i}.decoder.key   self-attention key of decoder layer i, fed back each step
    past_key_values.{i}.encoder.key   cross-attention key of decoder layer i, computed by the encoder
    present.{i}.decoder.key           self-attention key after this step (past_len + new_len long)
    present.{i}.encoder.key           cross-attention key, an output of the encoder graph
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

# symbolic dimension names
BATCH, SRC_LEN, NEW_LEN, PAST_LEN, TOTAL_LEN = "batch", "src_len", "new_len", "past_len", "total_len"
INPUT_IDS = "input_ids"                          # both graphs: token ids (the embedding lookup reads it)
INPUT_FEATURES = "input_features"                # audio encoders (Whisper): log-mel features [B, n_mels, frames]
PAST_SEQUENCE_LENGTH = "past_sequence_length"   # static-cache decoders: how many buffer slots are filled (per row on CPU)
CACHE_LEN = "cache_len"                          # static-cache decoders: buffer length (<= max_len, chosen per request)
POSITION_IDS = "position_ids"                    # decoders: each new token's position in its own target sequence
DECODER_ATTENTION_MASK = "decoder_attention_mask"  # decoders: 1 where a cached self-attention key is a real token
VOCAB_IDS = "vocab_ids"                          # shortlist decoders: the target ids whose logits the step computes
SHORTLIST = "shortlist"                          # shortlist decoders: the logits' last dim (len(vocab_ids))
SHORTLIST_WEIGHT = "shortlist_weight"            # shortlist decoders: the projection's rows for vocab_ids, bound per request
KV_CACHES = ("dynamic", "static")
# the decoder layouts a manifest declares ("decoder_layout"): how its self-attention cache is fed
DYNAMIC = "dynamic"                  # past [B, H, past_len, Dh] in, present [B, H, past_len + new_len, Dh] out
STATIC_PER_ROW = "static-per-row"    # one buffer bound as past and present; past_sequence_length [B], no key mask
STATIC_SHARED = "static-shared"      # one buffer bound as past and present; past_sequence_length [1], key mask
DECODER_LAYOUTS = (DYNAMIC, STATIC_PER_ROW, STATIC_SHARED)


def kv_cache_of(layout: str) -> str:
    """The KV cache kind of a decoder layout: "dynamic" or "static" (the manifest's kv_cache, optimize's --kv-cache)."""
    return "dynamic" if layout == DYNAMIC else "static"


def takes_key_mask(layout: str) -> bool:
    """Whether a decoder of this layout takes decoder_attention_mask (the per-row static cache has nothing to mask)."""
    return layout != STATIC_PER_ROW


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, element type, and shape with symbolic (str) or fixed (int) dims."""

    name: str
    dtype: str                      # "int64" | "float32" | "float16"
    shape: tuple                    # e.g. ("batch", "src_len", 512)

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        return cls(d["name"], d["dtype"], tuple(d["shape"]))


@dataclass(frozen=True)
class GraphSpec:
    """A graph's file and interface."""

    name: str                       # "encoder" | "decoder"
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def to_dict(self) -> dict:
        return {"inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}


PAST, PRESENT = "past_key_values", "present"     # cache name kinds: graph inputs, graph outputs
SELF, CROSS = "decoder", "encoder"               # cache name attentions: self-attention, cross-attention
KV = ("key", "value")
_CACHE_NAME = re.compile(rf"^({PAST}|{PRESENT})\.(\d+)\.({SELF}|{CROSS})\.(key|value)$")


def cache_name(kind: str, layer: int, attn: str, kv: str) -> str:
    """The one place cache tensor names are made: kind 'past_key_values'|'present', attn 'decoder'|'encoder'."""
    return f"{kind}.{layer}.{attn}.{kv}"


def cache_names(n_layers: int, kind: str, attn: str) -> list[str]:
    """Every layer's key and value name of one kind and attention, in graph order (layer 0 key, value, ...)."""
    return [cache_name(kind, i, attn, kv) for i in range(n_layers) for kv in KV]


def parse_cache_name(name: str | None) -> tuple[str, int, str, str] | None:
    """(kind, layer, attn, kv) of a cache name, None for any other tensor name."""
    m = _CACHE_NAME.match(name or "")
    return None if m is None else (m[1], int(m[2]), m[3], m[4])


def is_cache(name: str | None, kind: str, attn: str) -> bool:
    """Whether `name` is a cache tensor of this kind and attention (e.g. PAST, SELF: a decoder's fed-back cache)."""
    parts = parse_cache_name(name)
    return parts is not None and parts[0] == kind and parts[2] == attn


def past_of(present: str) -> str:
    """The input a present is fed back as: present.{i}.{attn}.{kv} -> past_key_values.{i}.{attn}.{kv}."""
    kind, layer, attn, kv = _parse(present, PRESENT)
    return cache_name(PAST, layer, attn, kv)


def present_of(past: str) -> str:
    """The output that holds a past after the step: past_key_values.{i}.{attn}.{kv} -> present.{i}.{attn}.{kv}."""
    kind, layer, attn, kv = _parse(past, PAST)
    return cache_name(PRESENT, layer, attn, kv)


def _parse(name: str, kind: str) -> tuple[str, int, str, str]:
    parts = parse_cache_name(name)
    if parts is None or parts[0] != kind:
        raise ValueError(f"{name!r} is not a {kind} cache name")
    return parts


def empty_past(batch: int, n_heads: int, head_dim: int, dtype=np.float32) -> np.ndarray:
    """The self-attention cache of a first step: [batch, heads, 0, head_dim], zero positions."""
    return np.zeros((batch, n_heads, 0, head_dim), dtype=dtype)


def head_dim_of(config: dict) -> int:
    """The per-head size of a model config given as a dict: its d_kv (T5's), else d_model / n_heads."""
    return config.get("d_kv") or config["d_model"] // config["n_heads"]


def encoder_spec(n_decoder_layers: int, n_heads: int, d_model: int, float_type: str = "float32",
                 head_dim: int | None = None, features: tuple[int, int] | None = None) -> GraphSpec:
    """encoder.onnx: token ids and mask in; hidden states and every decoder layer's cross-attention K/V out
    (head_dim: d_model / n_heads unless given). An audio encoder (features: (n_mels, frames), feature_shape) takes
    `input_features` float32 [B, n_mels, frames] and no mask; its outputs have frames / 2 positions, a fixed size
    (Whisper's inputs are always 30 s: 3000 frames, 1500 positions)."""
    head_dim = head_dim or d_model // n_heads
    src_len = SRC_LEN if features is None else features[1] // 2
    kv_shape = (BATCH, n_heads, src_len, head_dim)
    outputs = [TensorSpec("encoder_hidden_states", float_type, (BATCH, src_len, d_model))]
    for i in range(n_decoder_layers):
        outputs += [TensorSpec(cache_name(PRESENT, i, CROSS, kv), float_type, kv_shape) for kv in KV]
    if features is not None:
        inputs = (TensorSpec(INPUT_FEATURES, "float32", (BATCH, *features)),)
    else:
        inputs = (TensorSpec(INPUT_IDS, "int64", (BATCH, SRC_LEN)), TensorSpec("attention_mask", "int64", (BATCH, SRC_LEN)))
    return GraphSpec("encoder", inputs=inputs, outputs=tuple(outputs))


def feature_shape(config: dict) -> tuple[int, int] | None:
    """(n_mels, frames) of one input of an audio encoder (the config's encoder_input "features"), None for a
    token encoder: frames = 2 * source_positions (conv2's stride)."""
    if config.get("encoder_input", "tokens") != "features":
        return None
    return config["n_mels"], 2 * config["source_positions"]


def decoder_spec(n_decoder_layers: int, n_heads: int, d_model: int, vocab_size: int,
                 float_type: str = "float32", layout: str = DYNAMIC, head_dim: int | None = None) -> GraphSpec:
    """decoder.onnx: one cached step. Per layer, past self K/V and cross K/V in; logits and present self K/V out.

    The dynamic cache: present = past + new rows, a new tensor each step. The static cache
    (exporters/static_cache.py): past and present are one [B, H, cache_len, Dh] buffer the runtime allocates per
    request (cache_len = the tokens it may generate, at most max_len) and binds twice; `past_sequence_length` says
    how many slots are filled, and a step takes exactly one token. Per row (STATIC_PER_ROW, CPU bundles): int32 [B],
    each row's own filled length, the slot its new key/value is written at; every slot below it is the row's own
    token, so the static cache takes no `decoder_attention_mask`. Shared slot (STATIC_SHARED, CUDA bundles): int32
    [1] for all rows, with the key mask.

    Per-row inputs (rows of one batch may sit at different positions, as in in-flight batching):
    `position_ids` [B, new_len], each new token's position in its own target sequence (one request alone:
    past_len + 0..new_len-1), and `decoder_attention_mask` [B, past_len] (static: [B, cache_len]), 1 where a cached
    key/value slot holds a real token of that row, 0 where it holds none (a slot before the row joined, or beyond
    past_sequence_length). This step's new tokens are always attended, causally among themselves.
    `default_row_inputs` gives the one-request feeds (all slots real).
    """
    if layout not in DECODER_LAYOUTS:
        raise ValueError(f"unknown decoder layout {layout!r}; one of {DECODER_LAYOUTS}")
    head_dim = head_dim or d_model // n_heads
    static_cache = layout != DYNAMIC
    new_len = 1 if static_cache else NEW_LEN
    past_len, total_len = (CACHE_LEN, CACHE_LEN) if static_cache else (PAST_LEN, TOTAL_LEN)
    inputs = [TensorSpec(INPUT_IDS, "int64", (BATCH, new_len)),
              TensorSpec("encoder_attention_mask", "int64", (BATCH, SRC_LEN))]
    if static_cache:
        inputs.append(TensorSpec(PAST_SEQUENCE_LENGTH, "int32", (BATCH,) if layout == STATIC_PER_ROW else (1,)))
    inputs.append(TensorSpec(POSITION_IDS, "int64", (BATCH, new_len)))
    if takes_key_mask(layout):
        inputs.append(TensorSpec(DECODER_ATTENTION_MASK, "int64", (BATCH, past_len)))
    outputs = [TensorSpec("logits", float_type, (BATCH, new_len, vocab_size))]
    for i in range(n_decoder_layers):
        inputs += [TensorSpec(cache_name(PAST, i, SELF, kv), float_type, (BATCH, n_heads, past_len, head_dim))
                   for kv in KV]
        inputs += [TensorSpec(cache_name(PAST, i, CROSS, kv), float_type, (BATCH, n_heads, SRC_LEN, head_dim))
                   for kv in KV]
        outputs += [TensorSpec(cache_name(PRESENT, i, SELF, kv), float_type, (BATCH, n_heads, total_len, head_dim))
                    for kv in KV]
    return GraphSpec("decoder", inputs=tuple(inputs), outputs=tuple(outputs))


def shortlist_decoder_spec(decoder: GraphSpec, weight: dict | None = None) -> GraphSpec:
    """A decoder's shortlist variant (`onnxformer shortlist` writes it): the same graph with more inputs,
    `vocab_ids` int64 [shortlist], the target ids to compute, and (`weight`: the manifest's shortlist "weight" record)
    `shortlist_weight`, the output projection's weights for those ids, gathered once per request by the runtime:
    rows [shortlist, D] ("feed": "rows", fp32) or columns [D, shortlist] ("columns", int8) of the record's dtype.
    Its logits hold those ids' columns, in that order. Without `weight`: the first form, which gathered the rows
    inside the graph every step (bundles shortlisted before 2026-12-02)."""
    outputs = tuple(TensorSpec(t.name, t.dtype, t.shape[:-1] + (SHORTLIST,)) if t.name == "logits" else t
                    for t in decoder.outputs)
    inputs = decoder.inputs + (TensorSpec(VOCAB_IDS, "int64", (SHORTLIST,)),)
    if weight is not None:
        width = int(weight["shape"][1])
        shape = (SHORTLIST, width) if weight["feed"] == "rows" else (width, SHORTLIST)
        inputs += (TensorSpec(SHORTLIST_WEIGHT, str(weight["dtype"]), shape),)
    return GraphSpec(decoder.name, inputs, outputs)


def default_row_inputs(batch: int, past_len: int, new_len: int = 1, layout: str = DYNAMIC) -> dict:
    """position_ids and (where the layout takes it) decoder_attention_mask of rows that all start at position 0 with
    every slot filled, as one request alone sits: positions past_len + 0..new_len-1, every cached key real."""
    positions = np.arange(past_len, past_len + new_len, dtype=np.int64)
    feeds = {POSITION_IDS: np.ascontiguousarray(np.broadcast_to(positions, (batch, new_len)))}
    if takes_key_mask(layout):
        feeds[DECODER_ATTENTION_MASK] = np.ones((batch, past_len), dtype=np.int64)
    return feeds


def source_vocab_size(config: dict) -> int:
    """Size of the source vocabulary: the encoder's input ids (the target's when the model shares one)."""
    return config.get("src_vocab_size") or config["vocab_size"]


def source_pad_id(config: dict) -> int:
    """The id source rows are padded with: pad, or 0 where pad lies outside a separate source vocabulary (padded
    positions are masked, so any id inside the vocabulary gives the same outputs)."""
    return config["pad_id"] if config["pad_id"] < source_vocab_size(config) else 0


def suppressed_ids(config: dict) -> tuple[int, ...]:
    """Token ids the model never generates: pad, for models that start decoding from it (Marian), and its
    suppress_tokens (Whisper's generation config)."""
    pad = (config["pad_id"],) if config.get("suppress_pad") else ()
    return tuple(sorted({*pad, *(config.get("suppress_tokens") or ())}))


def begin_suppressed_ids(config: dict) -> tuple[int, ...]:
    """Token ids never generated as the first token after the forced prefix (Whisper's begin_suppress_tokens)."""
    return tuple(sorted(config.get("begin_suppress_tokens") or ()))


def forces_eos(config: dict) -> bool:
    """Whether the model's targets end with EOS at the length limit by default (transformers' forced_eos_token_id,
    recorded at import as the config's forced_eos); a request's forced_eos option decides over it."""
    return bool(config.get("forced_eos", False))


def graph_specs(config: dict, float_type: str = "float32", layout: str = DYNAMIC) -> dict[str, GraphSpec]:
    """Both graphs' specs from a model config given as a dict (as stored in config.json and the manifest) and the
    decoder's layout (the manifest's decoder_layout)."""
    L, H, D, V = config["n_decoder_layers"], config["n_heads"], config["d_model"], config["vocab_size"]
    dh = head_dim_of(config)
    return {"encoder": encoder_spec(L, H, D, float_type, dh, feature_shape(config)),
            "decoder": decoder_spec(L, H, D, V, float_type, layout, dh)}


def config_field_of(tensor: str, axis: int) -> str:
    """The model config field a fixed dim of a graph input or output comes from (load-time checks name it)."""
    if tensor == "logits":
        return "vocab_size"
    if tensor == INPUT_FEATURES:
        return "n_mels" if axis == 1 else "source_positions (frames = 2 * source_positions)"
    if tensor == "encoder_hidden_states":
        return "source_positions" if axis == 1 else "d_model"   # axis 1: an audio encoder's fixed length
    if axis == 2:
        return "source_positions"                   # a cross cache's source axis (self caches' is symbolic)
    return "n_heads" if axis == 1 else "d_kv, else d_model / n_heads (head_dim)"


__all__ = ["TensorSpec", "GraphSpec", "PAST_SEQUENCE_LENGTH", "CACHE_LEN", "POSITION_IDS", "DECODER_ATTENTION_MASK",
           "VOCAB_IDS", "SHORTLIST", "SHORTLIST_WEIGHT", "shortlist_decoder_spec",
           "DYNAMIC", "STATIC_PER_ROW", "STATIC_SHARED", "DECODER_LAYOUTS", "kv_cache_of", "takes_key_mask",
           "default_row_inputs", "config_field_of", "KV_CACHES", "PAST", "PRESENT", "SELF",
           "CROSS", "KV", "cache_name", "cache_names", "parse_cache_name", "is_cache", "past_of", "present_of",
           "empty_past", "head_dim_of", "encoder_spec", "decoder_spec", "graph_specs", "source_vocab_size",
           "source_pad_id", "suppressed_ids", "forces_eos", "INPUT_FEATURES", "feature_shape", "begin_suppressed_ids"]
