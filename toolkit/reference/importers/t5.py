"""Hugging Face T5 (T5ForConditionalGeneration: t5, T5 v1.1, Flan-T5, ByT5; MT5ForConditionalGeneration: mT5) ->
the reference model.

T5 (Raffel et al., 2020) is the paper's Transformer with these variants, all set in the imported ModelConfig:
pre-norm stacks ending with a norm, RMSNorm (a gain only, variance in float32: normalization "rms"), no absolute
positions but a bucketed relative position bias per stack (positions "none", relative_buckets,
relative_max_distance: bidirectional in the encoder, one-way in the decoder, stored by the first layer of each
stack and added in every layer), unscaled attention scores and no projection biases (attention_scale and
linear_bias false), embeddings not scaled, decoding from pad (which T5 may generate: suppress_pad false).

    variant              feed_forward_proj    FFN                       head
    t5 (original)        relu                 ReLU                      tied, decoder output times d_model**-0.5
    v1.1, Flan-T5, mT5   gated-gelu           (gelu_new(x W0) * x W1) W2   untied lm_head
    ByT5                 gated-gelu           as v1.1                   untied; a byte tokenizer (runtime/tokenizer)

Which head: lm_head.weight absent or equal to shared.weight is tied, as transformers ties it; the rescale follows
config.json's scale_decoder_outputs, else its tie_word_embeddings (not false: rescaled), as transformers reads them.
Refused by name: other feed_forward_proj activations, is_gated_act / dense_act_fn that disagree with
feed_forward_proj, a relative bias in another layer than the first (UMT5's per-layer tables), embeddings that
differ per side, any weight left over. Tokenizers: tokenizer.json (FastTokenizer, `tokens </s>`), else spiece.model
converted offline by transformers into one, else ByT5Tokenizer's bytes (runtime.tokenizer.ByteTokenizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.reference.config import ModelConfig
from toolkit.reference.importers.marian import load_state
from toolkit.reference.importers.registry import Converted, Family, ImportOptions, ImportRefused, register_family
from toolkit.reference.importers.sources import (forced_eos, model_of, one_eos, quiet_from_pretrained, read_json,
                                                 require_transformers, with_generation_config)

if TYPE_CHECKING:
    import torch

MODEL_TYPES = ("t5", "mt5")
TITLES = {"t5": "T5ForConditionalGeneration", "mt5": "MT5ForConditionalGeneration"}
REQUIRED = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "pad_token_id", "eos_token_id")
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "silu": "silu", "swish": "silu"}       # transformers' ACT2FN name -> ours
DEFAULT_MAX_LEN = 512                                 # T5's n_positions: the longest source and target we accept
LAYER = {   # T5's names inside a block -> ours inside a layer, per side
    "encoder": {"layer.0.SelfAttention.{p}": "self_attn.{p}_proj", "layer.0.layer_norm": "sublayers.0.norm",
                "layer.1.DenseReluDense.{f}": "ffn.{f}", "layer.1.layer_norm": "sublayers.1.norm"},
    "decoder": {"layer.0.SelfAttention.{p}": "self_attn.{p}_proj", "layer.0.layer_norm": "sublayers.0.norm",
                "layer.1.EncDecAttention.{p}": "cross_attn.{p}_proj", "layer.1.layer_norm": "sublayers.1.norm",
                "layer.2.DenseReluDense.{f}": "ffn.{f}", "layer.2.layer_norm": "sublayers.2.norm"},
}
PROJECTIONS = {"q": "q", "k": "k", "v": "v", "o": "out"}
FFN = {False: {"wi": "w_1", "wo": "w_2"}, True: {"wi_0": "w_1", "wi_1": "w_3", "wo": "w_2"}}
IGNORED = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"   # transformers ignores it too


def feed_forward(hf: dict, where: Path) -> tuple[str, bool]:
    """(our activation, gated) of config.json's feed_forward_proj, as transformers derives them."""
    proj = hf.get("feed_forward_proj", "relu")
    parts = str(proj).split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ImportRefused(f"{where}: feed_forward_proj {proj!r} is not 'ACT' or 'gated-ACT'")
    gated, act = len(parts) == 2, "gelu_new" if proj == "gated-gelu" else parts[-1]
    saved = (hf.get("is_gated_act", gated), hf.get("dense_act_fn", act))
    if saved != (gated, act):
        raise ImportRefused(f"{where}: is_gated_act / dense_act_fn {saved} disagree with feed_forward_proj {proj!r} "
                            f"(which implies {(gated, act)}); transformers versions read them differently, so the "
                            f"model is ambiguous: fix config.json")
    if act not in ACTIVATIONS:
        raise ImportRefused(f"{where}: feed_forward_proj {proj!r}: activation {act!r} cannot be represented "
                            f"(supported: {', '.join(sorted(ACTIVATIONS))}, gated or not)")
    return ACTIVATIONS[act], gated


def model_config(hf: dict, tied: bool, where: Path) -> ModelConfig:
    """The ModelConfig of a T5 config.json (tied: whether the weights tie the head), refusing what it cannot hold."""
    missing = [k for k in REQUIRED if k not in hf]
    if missing:
        raise ImportRefused(f"{where} lacks {', '.join(missing)}; save the model again with save_pretrained")
    act, gated = feed_forward(hf, where)
    eos, pad = hf["eos_token_id"], hf["pad_token_id"]
    eos = one_eos(eos, where)
    heads, d_kv, d = hf["num_heads"], hf["d_kv"], hf["d_model"]
    rescale = hf["scale_decoder_outputs"] if "scale_decoder_outputs" in hf else \
        hf.get("tie_word_embeddings", True) is not False
    start = hf.get("decoder_start_token_id")
    fields = dict(vocab_size=hf["vocab_size"], d_model=d, n_heads=heads, n_encoder_layers=hf["num_layers"],
                  n_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"], d_ff=hf["d_ff"],
                  d_kv=None if isinstance(d_kv, int) and d_kv * heads == d else d_kv,
                  max_len=hf.get("n_positions") or DEFAULT_MAX_LEN, dropout=float(hf.get("dropout_rate", 0.1)),
                  norm="pre", activation=act, gated_ffn=gated, tie_embeddings=tied, head_rescale=bool(rescale),
                  layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)), pad_id=pad,
                  bos_id=pad if start is None else start, eos_id=eos, positions="none", scale_embeddings=False,
                  normalization="rms", attention_scale=False, linear_bias=False,
                  relative_buckets=hf.get("relative_attention_num_buckets", 32),
                  relative_max_distance=hf.get("relative_attention_max_distance", 128),
                  forced_eos=forced_eos(hf, eos, where))
    try:
        return ModelConfig(**fields)
    except Exception as exc:
        raise ImportRefused(f"{where}: the config cannot be represented ({exc})") from None


def take_embeddings(state: dict, where: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """The token embeddings and head, popped from state: ({ours: tensor}, tied). Per-side copies must equal
    shared.weight; lm_head.weight absent or equal to it is the tied head."""
    import torch

    shared = state.pop("shared.weight", None)
    if shared is None:
        raise ImportRefused(f"{where}: the weights lack shared.weight; this is not a T5 checkpoint")
    for side in ("encoder", "decoder"):
        copy = state.pop(f"{side}.embed_tokens.weight", None)
        if copy is not None and not torch.equal(copy, shared):
            raise ImportRefused(f"{where}: {side}.embed_tokens.weight differs from shared.weight; embeddings of "
                                f"their own per side cannot be represented for T5")
    head = state.pop("lm_head.weight", None)
    tied = head is None or torch.equal(head, shared)
    return {"embed.lut.weight": shared, **({} if tied else {"generator.proj.weight": head})}, tied


def take_layers(state: dict, config: ModelConfig, where: Path) -> dict[str, torch.Tensor]:
    """Every block's weights, the relative position tables and the final norms, popped from state."""
    out = {}
    for side, layers in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        for i in range(layers):
            for theirs, ours in LAYER[side].items():
                for a, b in (PROJECTIONS if "{p}" in theirs else FFN[config.gated_ffn] if "{f}" in theirs
                             else {"": ""}).items():
                    name = f"{side}.block.{i}.{theirs.format(p=a, f=a)}.weight"
                    if name not in state:
                        raise ImportRefused(f"{where}: the weights lack {name}; they do not match config.json "
                                            f"(feed_forward_proj, num_layers)")
                    out[f"{side}.layers.{i}.{ours.format(p=b, f=b)}.weight"] = state.pop(name)
        table = state.pop(f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", None)
        if table is None:
            raise ImportRefused(f"{where}: the weights lack {side}'s relative_attention_bias (block 0)")
        out[f"{side}.relative_bias.embedding.weight"] = table
        out[f"{side}.norm.weight"] = state.pop(f"{side}.final_layer_norm.weight", None)
        if out[f"{side}.norm.weight"] is None:
            raise ImportRefused(f"{where}: the weights lack {side}.final_layer_norm.weight")
    state.pop(IGNORED, None)
    per_layer = sorted(k for k in state if "relative_attention_bias" in k)
    if per_layer:
        raise ImportRefused(f"{where}: {per_layer[0]}: a relative position bias in a later layer (per-layer tables, "
                            f"as UMT5 has) cannot be represented; the reference model has one table per stack")
    return out


def convert_state(hf: dict, state: dict[str, torch.Tensor], where: Path = Path("config.json")):
    """The reference Transformer (eval mode) of a T5 config.json (a dict) and its state dict."""
    if hf.get("model_type") not in MODEL_TYPES:
        raise ImportRefused(f"{where} has model_type {hf.get('model_type')!r}, not one of {', '.join(MODEL_TYPES)}")
    state = dict(state)
    mapped, tied = take_embeddings(state, where)
    config = model_config(hf, tied, where)
    mapped.update(take_layers(state, config, where))
    if state:
        left = sorted(state)
        raise ImportRefused(f"{where}: {len(left)} weight(s) cannot be represented: {', '.join(left[:4])}"
                            f"{' ...' if len(left) > 4 else ''}")
    return model_of(config, mapped, where)


def load_t5(directory: str | Path, progress=None):
    """The reference Transformer of a T5 / mT5 save_pretrained directory."""
    directory = Path(directory)
    hf = with_generation_config(directory, read_json(directory / "config.json"))
    return convert_state(hf, load_state(directory, progress or (lambda msg: None)), directory / "config.json")


def convert(directory: Path, options: ImportOptions) -> Converted:
    """The registry's convert: the reference Transformer and tokenizer (or None) of a local T5 directory."""
    from toolkit.reference.importers.t5_tokenizer import t5_tokenizer

    model = load_t5(directory, options.progress)
    tokenizer = t5_tokenizer(directory, model.config, options.work)
    if tokenizer is None:
        options.progress(f"{directory} has no tokenizer (tokenizer.json, spiece.model or ByT5's "
                         f"tokenizer_config.json): the checkpoint takes token ids only")
    return Converted(model, tokenizer, {"files": sorted(p.name for p in directory.iterdir() if p.is_file())})


def load_original(directory: Path):
    """(T5ForConditionalGeneration or MT5ForConditionalGeneration in eval mode, its tokenizer): parity's reference."""
    transformers = require_transformers("parity against a T5 directory")
    model_type = read_json(Path(directory) / "config.json").get("model_type")
    cls = getattr(transformers, TITLES.get(model_type, TITLES["t5"]))
    model = quiet_from_pretrained(cls.from_pretrained, directory).eval()
    return model, quiet_from_pretrained(transformers.AutoTokenizer.from_pretrained, directory)


FAMILY = register_family(Family(
    name="t5", source="a T5, T5 v1.1, Flan-T5, mT5 or ByT5 save_pretrained directory or hub name", convert=convert,
    model_types=MODEL_TYPES, load_original=load_original,
    original="T5ForConditionalGeneration / MT5ForConditionalGeneration (transformers)",
    hub_files=("*.json", "spiece.model", "*.safetensors", "pytorch_model.bin")))

__all__ = ["FAMILY", "convert", "convert_state", "feed_forward", "load_original", "load_t5", "model_config"]
