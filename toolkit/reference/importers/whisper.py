"""Hugging Face Whisper (WhisperForConditionalGeneration: openai/whisper-tiny .. large-v3, the .en models,
distil-whisper) -> the reference model.

Whisper (Radford et al., 2022) is the paper's Transformer with these variants, all set in the imported ModelConfig:
an audio encoder (encoder_input "features": log-mel features [B, num_mel_bins, 2 * max_source_positions] through
conv1 and conv2, each followed by exact GELU, plus encoder.embed_positions, the checkpoint's sinusoid table; no
encoder mask), learned decoder positions (positions "table", max_target_positions rows, no offset), pre-norm stacks
ending with a LayerNorm, the FFN's activation_function, embeddings not scaled (transformers computes an embed_scale
from scale_embedding but never applies it), the head tied to the decoder embeddings, biases on q, v and out but none
on k (key_bias false), pad = eos (nothing is padded: the encoder's input is fixed-length), decoding from
decoder_start_token_id (<|startoftranscript|>), and generation_config.json's suppress_tokens and
begin_suppress_tokens (the search's suppressed ids, and those of the first step after the forced prompt).

Refused by name: encoder and decoder with different heads or FFN sizes, an activation the reference model lacks, an
untied proj_out, several EOS ids, any weight left over. The prompt [<|startoftranscript|>, <|lang|>, <|task|>,
<|notimestamps|>] is the tokenizer's data (importers/whisper_tokenizer.py; runtime/speech.py gives its ids).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.reference.config import ModelConfig
from toolkit.reference.importers.marian import DECODER_LAYER, ENCODER_LAYER, load_state
from toolkit.reference.importers.registry import Converted, Family, ImportOptions, ImportRefused, register_family
from toolkit.reference.importers.sources import (model_of, one_eos, quiet_from_pretrained, read_json,
                                                 require_transformers)
from toolkit.reference.importers.t5 import ACTIVATIONS

if TYPE_CHECKING:
    import torch

REQUIRED = ("vocab_size", "num_mel_bins", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
            "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "max_source_positions",
            "max_target_positions", "eos_token_id")
STEM = {"conv1.weight": "audio.conv1.weight", "conv1.bias": "audio.conv1.bias", "conv2.weight": "audio.conv2.weight",
        "conv2.bias": "audio.conv2.bias", "embed_positions.weight": "audio.pe"}     # encoder.* -> ours
GENERATION = ("decoder_start_token_id", "eos_token_id", "pad_token_id", "suppress_tokens", "begin_suppress_tokens")


def generation_fields(directory: Path, hf: dict) -> dict:
    """config.json's fields with what generate reads from generation_config.json (which decides where present)."""
    path = directory / "generation_config.json"
    gen = read_json(path) if path.is_file() else {}
    return {**hf, **{k: gen[k] for k in GENERATION if k in gen}}


def model_config(hf: dict, where: Path) -> ModelConfig:
    """The ModelConfig of a Whisper config.json (with its generation fields), refusing what it cannot hold."""
    missing = [k for k in REQUIRED if k not in hf]
    if missing:
        raise ImportRefused(f"{where} lacks {', '.join(missing)}; save the model again with save_pretrained")
    for what, (a, b) in {"attention heads": ("encoder_attention_heads", "decoder_attention_heads"),
                         "feed-forward sizes": ("encoder_ffn_dim", "decoder_ffn_dim")}.items():
        if hf[a] != hf[b]:
            raise ImportRefused(f"{where}: encoder and decoder have different {what} ({hf[a]} vs {hf[b]}); "
                                f"the reference model has one value for both")
    act = hf.get("activation_function", "gelu")
    if act not in ACTIVATIONS:
        raise ImportRefused(f"{where}: activation {act!r} cannot be represented (supported: "
                            f"{', '.join(sorted(ACTIVATIONS))})")
    if hf.get("tie_word_embeddings", True) is False:
        raise ImportRefused(f"{where}: tie_word_embeddings is false; an untied Whisper head cannot be represented")
    eos = hf["eos_token_id"]
    eos = one_eos(eos, where)
    start = hf.get("decoder_start_token_id")
    if start is None:
        raise ImportRefused(f"{where} has no decoder_start_token_id (<|startoftranscript|>); set it and import again")
    pad = hf.get("pad_token_id")
    fields = dict(vocab_size=hf["vocab_size"], d_model=hf["d_model"], n_heads=hf["encoder_attention_heads"],
                  n_encoder_layers=hf["encoder_layers"], n_decoder_layers=hf["decoder_layers"],
                  d_ff=hf["encoder_ffn_dim"], max_len=hf["max_target_positions"],
                  dropout=float(hf.get("dropout", 0.0)), norm="pre", activation=ACTIVATIONS[act],
                  tie_embeddings=True, layer_norm_eps=1e-5, pad_id=eos if pad is None else pad, bos_id=start,
                  eos_id=eos, positions="table", scale_embeddings=False, encoder_input="features",
                  n_mels=hf["num_mel_bins"], source_positions=hf["max_source_positions"], key_bias=False,
                  suppress_tokens=tuple(hf.get("suppress_tokens") or ()),
                  begin_suppress_tokens=tuple(hf.get("begin_suppress_tokens") or ()))
    try:
        return ModelConfig(**fields)
    except Exception as exc:
        raise ImportRefused(f"{where}: the config cannot be represented ({exc})") from None


def map_state(state: dict[str, torch.Tensor], config: ModelConfig, where: Path) -> dict[str, torch.Tensor]:
    """Whisper's parameter names -> ours, popped from state: the stem, both stacks (k_proj without bias), the
    final LayerNorms, the decoder's embeddings and positions; proj_out must equal the embeddings (tied)."""
    import torch

    out = {}

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ImportRefused(f"{where}: the weights lack {name}; they do not match config.json")
        return state.pop(name)

    for theirs, ours in STEM.items():
        out[ours] = take(f"encoder.{theirs}")
    out["embed.lut.weight"] = take("decoder.embed_tokens.weight")
    out["pos.pe"] = take("decoder.embed_positions.weight")
    for side, layers, mapping in (("encoder", config.n_encoder_layers, ENCODER_LAYER),
                                  ("decoder", config.n_decoder_layers, DECODER_LAYER)):
        for i in range(layers):
            for theirs, ours in mapping.items():
                for p in ("q", "k", "v", "out") if "{p}" in theirs else ("",):
                    for kind in ("weight",) if p == "k" else ("weight", "bias"):
                        out[f"{side}.layers.{i}.{ours.format(p=p)}.{kind}"] = \
                            take(f"{side}.layers.{i}.{theirs.format(p=p)}.{kind}")
        for kind in ("weight", "bias"):
            out[f"{side}.norm.{kind}"] = take(f"{side}.layer_norm.{kind}")
    head = state.pop("proj_out.weight", None)
    if head is not None and not torch.equal(head, out["embed.lut.weight"]):
        raise ImportRefused(f"{where}: proj_out.weight differs from decoder.embed_tokens.weight; an untied Whisper "
                            f"head cannot be represented")
    if state:
        left = sorted(state)
        hint = " (a key projection bias: k_proj has none in Whisper)" if any("k_proj.bias" in k for k in left) else ""
        raise ImportRefused(f"{where}: {len(left)} weight(s) cannot be represented{hint}: {', '.join(left[:4])}"
                            f"{' ...' if len(left) > 4 else ''}")
    return out


def convert_state(hf: dict, state: dict[str, torch.Tensor], where: Path = Path("config.json")):
    """The reference Transformer (eval mode) of a Whisper config.json (a dict, generation fields merged) and the
    state dict of its WhisperForConditionalGeneration (keys with or without "model.")."""
    if hf.get("model_type") != "whisper":
        raise ImportRefused(f"{where} has model_type {hf.get('model_type')!r}, not 'whisper'")
    config = model_config(hf, where)
    state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    mapped = map_state(state, config, where)
    return model_of(config, mapped, where)


def load_whisper(directory: str | Path, progress=None):
    """The reference Transformer of a Whisper save_pretrained directory."""
    directory = Path(directory)
    hf = generation_fields(directory, read_json(directory / "config.json"))
    return convert_state(hf, load_state(directory, progress or (lambda msg: None)), directory / "config.json")


def convert(directory: Path, options: ImportOptions) -> Converted:
    """The registry's convert: the reference Transformer and tokenizer (or None) of a local Whisper directory."""
    from toolkit.reference.importers.whisper_tokenizer import whisper_tokenizer

    model = load_whisper(directory, options.progress)
    tokenizer = whisper_tokenizer(directory, model.config)
    if tokenizer is None:
        options.progress(f"{directory} has no tokenizer.json: the checkpoint gives token ids only")
    return Converted(model, tokenizer, {"files": sorted(p.name for p in directory.iterdir() if p.is_file())})


def load_original(directory: Path):
    """(WhisperForConditionalGeneration in eval mode, its tokenizer or None): parity's reference."""
    transformers = require_transformers("parity against a Whisper directory")
    model = quiet_from_pretrained(transformers.WhisperForConditionalGeneration.from_pretrained, directory).eval()
    try:
        tokenizer = quiet_from_pretrained(transformers.AutoTokenizer.from_pretrained, directory)
    except Exception:                                   # a model without a tokenizer is compared by its ids
        tokenizer = None
    return model, tokenizer


FAMILY = register_family(Family(
    name="whisper", source="a Whisper or distil-whisper save_pretrained directory or hub name", convert=convert,
    model_types=("whisper",), load_original=load_original, original="WhisperForConditionalGeneration (transformers)",
    hub_files=("*.json", "*.safetensors", "pytorch_model.bin")))

__all__ = ["FAMILY", "convert", "convert_state", "generation_fields", "load_original", "load_whisper",
           "model_config"]
