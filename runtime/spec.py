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

from dataclasses import asdict, dataclass

# symbolic dimension names
BATCH, SRC_LEN, NEW_LEN, PAST_LEN, TOTAL_LEN = "batch", "src_len", "new_len", "past_len", "total_len"
INPUT_IDS = "input_ids"                          # both graphs: token ids (the embedding lookup reads it)
PAST_SEQUENCE_LENGTH = "past_sequence_length"   # static-cache decoders: how many buffer rows are filled
CACHE_LEN = "cache_len"                          # static-cache decoders: buffer length (<= max_len, chosen per request)
KV_CACHES = ("dynamic", "static")


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


def cache_name(kind: str, layer: int, attn: str, kv: str) -> str:
    """The one place cache tensor names are made: kind 'past_key_values'|'present', attn 'decoder'|'encoder'."""
    return f"{kind}.{layer}.{attn}.{kv}"


def encoder_spec(n_decoder_layers: int, n_heads: int, d_model: int, float_type: str = "float32") -> GraphSpec:
    """encoder.onnx: token ids and mask in; hidden states and every decoder layer's cross-attention K/V out."""
    head_dim = d_model // n_heads
    kv_shape = (BATCH, n_heads, SRC_LEN, head_dim)
    outputs = [TensorSpec("encoder_hidden_states", float_type, (BATCH, SRC_LEN, d_model))]
    for i in range(n_decoder_layers):
        outputs += [TensorSpec(cache_name("present", i, "encoder", kv), float_type, kv_shape) for kv in ("key", "value")]
    return GraphSpec(
        "encoder",
        inputs=(TensorSpec(INPUT_IDS, "int64", (BATCH, SRC_LEN)),
                TensorSpec("attention_mask", "int64", (BATCH, SRC_LEN))),
        outputs=tuple(outputs),
    )


def decoder_spec(n_decoder_layers: int, n_heads: int, d_model: int, vocab_size: int,
                 float_type: str = "float32", static_cache: bool = False) -> GraphSpec:
    """decoder.onnx: one cached step. Per layer, past self K/V and cross K/V in; logits and present self K/V out.

    The dynamic cache: present = past + new rows, a new tensor each step. The static cache
    (exporters/static_cache.py): past and present are one [B, H, cache_len, Dh] buffer the runtime allocates per
    request (cache_len = the tokens it may generate, at most max_len) and binds twice; `past_sequence_length` says
    how many rows are filled, and a step takes exactly one token.
    """
    head_dim = d_model // n_heads
    new_len = 1 if static_cache else NEW_LEN
    past_len, total_len = (CACHE_LEN, CACHE_LEN) if static_cache else (PAST_LEN, TOTAL_LEN)
    inputs = [TensorSpec(INPUT_IDS, "int64", (BATCH, new_len)),
              TensorSpec("encoder_attention_mask", "int64", (BATCH, SRC_LEN))]
    if static_cache:
        inputs.append(TensorSpec(PAST_SEQUENCE_LENGTH, "int32", (1,)))
    outputs = [TensorSpec("logits", float_type, (BATCH, new_len, vocab_size))]
    for i in range(n_decoder_layers):
        for kv in ("key", "value"):
            inputs.append(TensorSpec(cache_name("past_key_values", i, "decoder", kv), float_type,
                                     (BATCH, n_heads, past_len, head_dim)))
        for kv in ("key", "value"):
            inputs.append(TensorSpec(cache_name("past_key_values", i, "encoder", kv), float_type,
                                     (BATCH, n_heads, SRC_LEN, head_dim)))
        for kv in ("key", "value"):
            outputs.append(TensorSpec(cache_name("present", i, "decoder", kv), float_type,
                                      (BATCH, n_heads, total_len, head_dim)))
    return GraphSpec("decoder", inputs=tuple(inputs), outputs=tuple(outputs))


def graph_specs(config: dict, float_type: str = "float32", kv_cache: str = "dynamic") -> dict[str, GraphSpec]:
    """Both graphs' specs from a model config given as a dict (as stored in config.json and the manifest)."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; one of {KV_CACHES}")
    L, H, D, V = config["n_decoder_layers"], config["n_heads"], config["d_model"], config["vocab_size"]
    static = kv_cache == "static"
    return {"encoder": encoder_spec(L, H, D, float_type), "decoder": decoder_spec(L, H, D, V, float_type, static)}


__all__ = ["TensorSpec", "GraphSpec", "PAST_SEQUENCE_LENGTH", "CACHE_LEN", "KV_CACHES", "cache_name", "encoder_spec", "decoder_spec", "graph_specs", "asdict"]
