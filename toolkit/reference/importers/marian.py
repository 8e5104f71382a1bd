"""Hugging Face Marian (opus-mt) -> onnxformer checkpoint.

SOURCE is a directory written by save_pretrained (what `huggingface-cli download Helsinki-NLP/opus-mt-en-de`
gives): config.json, model.safetensors or pytorch_model.bin, source.spm, target.spm, vocab.json and, for models
with separate vocabularies, target_vocab.json; tokenizer_config.json and generation_config.json are read when
present. A hub name is downloaded by transformers where there is a network; without one the import exits 2.

Marian is the paper's Transformer with these variants, all set in the imported ModelConfig:
sin | cos position halves (positions="halves"), embeddings scaled by sqrt(d) only with scale_embedding, swish
(silu) or another activation, final_logits_bias (logits_bias), decoding starting from pad (bos_id = pad_id) and
never generating pad (suppress_pad, Marian's bad_words_ids), shared or separate vocabularies and embeddings, EOS
forced at the length limit where its forced_eos_token_id asks for it (forced_eos, a default of the search).
The weights are read with safetensors or torch.load(weights_only=True); transformers itself is not needed for a
local directory (only for downloads and for parity against MarianMTModel).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.reference.config import ModelConfig
from toolkit.reference.importers.registry import Converted, Family, ImportOptions, ImportRefused, register_family
from toolkit.reference.importers.sources import (forced_eos, one_eos, quiet_from_pretrained, read_json, read_state,
                                                 require_transformers, with_generation_config)

if TYPE_CHECKING:
    import torch

ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")
# config switches of other BART-family models that Marian checkpoints must leave off: feature -> (key, allowed)
REFUSED = {
    "pre-norm layers (normalize_before)": ("normalize_before", (False, None)),
    "pre-norm encoder (encoder_normalize_before)": ("encoder_normalize_before", (False, None)),
    "pre-norm decoder (decoder_normalize_before)": ("decoder_normalize_before", (False, None)),
    "an embedding LayerNorm (normalize_embedding)": ("normalize_embedding", (False, None)),
    "an embedding LayerNorm (layernorm_embedding)": ("layernorm_embedding", (False, None)),
    "a final stack LayerNorm (add_final_layer_norm)": ("add_final_layer_norm", (False, None)),
    "learned positions (static_position_embeddings false)": ("static_position_embeddings", (True, None)),
    "bias-free projections (add_bias_logits)": ("add_bias_logits", (False, None)),
}
ENCODER_LAYER = {"self_attn.{p}_proj": "self_attn.{p}_proj", "self_attn_layer_norm": "sublayers.0.norm",
                 "fc1": "ffn.w_1", "fc2": "ffn.w_2", "final_layer_norm": "sublayers.1.norm"}
DECODER_LAYER = {"self_attn.{p}_proj": "self_attn.{p}_proj", "self_attn_layer_norm": "sublayers.0.norm",
                 "encoder_attn.{p}_proj": "cross_attn.{p}_proj", "encoder_attn_layer_norm": "sublayers.1.norm",
                 "fc1": "ffn.w_1", "fc2": "ffn.w_2", "final_layer_norm": "sublayers.2.norm"}


def marian_model_config(hf: dict, where: Path) -> ModelConfig:
    """The ModelConfig of a Marian config.json, refusing by name what the reference model cannot represent."""
    for feature, (key, allowed) in REFUSED.items():
        if hf.get(key) not in allowed:
            raise ImportRefused(f"{where}: this model uses {feature}, which onnxformer's reference model cannot "
                                f"represent; it cannot be imported")
    act = hf.get("activation_function", "gelu")
    if act not in ACTIVATIONS:
        raise ImportRefused(f"{where}: activation {act!r} cannot be represented (supported: "
                            f"{', '.join(sorted(ACTIVATIONS))})")
    pairs = {"attention heads": ("encoder_attention_heads", "decoder_attention_heads"),
             "feed-forward sizes": ("encoder_ffn_dim", "decoder_ffn_dim")}
    for what, (a, b) in pairs.items():
        if hf.get(a) != hf.get(b):
            raise ImportRefused(f"{where}: encoder and decoder have different {what} ({hf.get(a)} vs {hf.get(b)}); "
                                f"the reference model has one value for both")
    vocab = hf.get("vocab_size")
    shared = hf.get("share_encoder_decoder_embeddings", True)
    target_vocab = vocab if shared else (hf.get("decoder_vocab_size") or vocab)
    pad, eos = hf.get("pad_token_id"), hf.get("eos_token_id")
    start = hf.get("decoder_start_token_id", pad)
    eos = one_eos(eos, where)
    fields = dict(vocab_size=target_vocab, src_vocab_size=None if shared else vocab, share_embeddings=shared,
                  d_model=hf.get("d_model"), n_heads=hf.get("encoder_attention_heads"),
                  n_encoder_layers=hf.get("encoder_layers"), n_decoder_layers=hf.get("decoder_layers"),
                  d_ff=hf.get("encoder_ffn_dim"), max_len=hf.get("max_position_embeddings"),
                  dropout=float(hf.get("dropout", 0.1)), norm="post", activation=ACTIVATIONS[act],
                  tie_embeddings=bool(hf.get("tie_word_embeddings", True)), layer_norm_eps=1e-5,
                  pad_id=pad, bos_id=start, eos_id=eos, positions="halves",
                  scale_embeddings=bool(hf.get("scale_embedding", False)), logits_bias=True, final_norm=False,
                  suppress_pad=True, forced_eos=forced_eos(hf, eos, where))
    if not isinstance(fields["d_model"], int) or fields["d_model"] % 2:
        raise ImportRefused(f"{where}: d_model {fields['d_model']} must be an even integer")
    try:
        return ModelConfig(**fields)
    except Exception as exc:
        raise ImportRefused(f"{where}: the config cannot be represented ({exc})") from None


def load_state(directory: Path, progress) -> dict[str, torch.Tensor]:
    """The weights: model.safetensors, else pytorch_model.bin (loaded with weights_only=True)."""
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return read_state(directory / name, "download the model again", progress)
    raise ImportRefused(f"{directory} has no weights ({' or '.join(WEIGHT_FILES)}); pass the complete model directory")


def map_state(state: dict[str, torch.Tensor], config: ModelConfig, where: Path) -> dict[str, torch.Tensor]:
    """Marian parameter names -> the reference model's; every Marian tensor must be used (or be the sinusoid
    table, checked equal to ours), so that nothing the original computes is dropped."""
    import torch

    state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    used: set[str] = set()
    out = map_embeddings(state, config, where, used)
    for side, layers, mapping in (("encoder", config.n_encoder_layers, ENCODER_LAYER),
                                  ("decoder", config.n_decoder_layers, DECODER_LAYER)):
        for i in range(layers):
            for theirs, ours in mapping.items():
                for p in ("q", "k", "v", "out") if "{p}" in theirs else ("",):
                    for kind in ("weight", "bias"):
                        name = f"{side}.layers.{i}.{theirs.format(p=p)}.{kind}"
                        if name not in state:
                            raise ImportRefused(f"{where}: the weights lack {name}; the checkpoint does not match "
                                                f"its config.json")
                        out[f"{side}.layers.{i}.{ours.format(p=p)}.{kind}"] = state[name]
                        used.add(name)
    unused = sorted(set(state) - used)
    if unused:
        feature = next((f for f in ("layernorm_embedding", "layer_norm", "embed_positions") if any(f in u for u in unused)),
                       None)
        hint = f" (it has {feature} weights the reference model lacks)" if feature else ""
        raise ImportRefused(f"{where}: {len(unused)} weight(s) cannot be represented{hint}: "
                            f"{', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}")
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def map_embeddings(state: dict[str, torch.Tensor], config: ModelConfig, where: Path,
                   used: set[str]) -> dict[str, torch.Tensor]:
    """Token embeddings (aliases checked equal to what they share), the output projection and logits bias, and the
    position tables (checked to be Marian's sinusoids); every name read is added to used."""
    import torch

    from toolkit.reference.model import sinusoid_table

    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return state[name]

    def first(*names: str) -> str | None:
        return next((n for n in names if n in state), None)

    target = first("decoder.embed_tokens.weight", "shared.weight")
    source = first("encoder.embed_tokens.weight", "shared.weight")
    if target is None or source is None:
        raise ImportRefused(f"{where}: the weights lack the token embeddings (shared.weight or "
                            f"encoder/decoder.embed_tokens.weight); this is not a MarianMTModel checkpoint")
    out["embed.lut.weight"] = take(target)
    if not config.share_embeddings:
        out["src_embed.lut.weight"] = take(source)
    for alias in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        if alias in state and alias not in used:
            if not torch.equal(state[alias], out["embed.lut.weight"] if config.share_embeddings or "decoder" in alias
                               else out["src_embed.lut.weight"]):
                raise ImportRefused(f"{where}: {alias} differs from the embedding it should share; the model's "
                                    f"embeddings are not shared as its config says")
            used.add(alias)
    if "lm_head.weight" in state:
        if config.tie_embeddings and not torch.equal(state["lm_head.weight"], out["embed.lut.weight"]):
            raise ImportRefused(f"{where}: lm_head.weight differs from the target embeddings but the config ties them "
                                f"(tie_word_embeddings); fix the config")
        used.add("lm_head.weight")
        if not config.tie_embeddings:
            out["generator.proj.weight"] = state["lm_head.weight"]
    elif not config.tie_embeddings:
        raise ImportRefused(f"{where}: the output projection is untied but lm_head.weight is missing")
    bias = state.get("final_logits_bias")
    out["generator.bias"] = take("final_logits_bias").reshape(-1) if bias is not None else \
        torch.zeros(config.vocab_size)
    table = sinusoid_table(config)
    for side in ("encoder", "decoder"):
        name = f"{side}.embed_positions.weight"
        if name in state:
            got = take(name)
            if got.shape != table.shape or not torch.allclose(got, table, atol=1e-6, rtol=0):
                raise ImportRefused(f"{where}: {name} is not Marian's sinusoid table (learned positions?); "
                                    f"learned positions cannot be represented")
    return out


def marian_tokenizer(directory: Path, config: ModelConfig):
    """The runtime SentencePieceTokenizer of a Marian directory (its files are copied into the checkpoint)."""
    from runtime.errors import TokenizerError
    from runtime.tokenizer import SentencePieceTokenizer

    missing = [f for f in TOKENIZER_FILES if not (directory / f).is_file()]
    if missing:
        raise ImportRefused(f"{directory} lacks the tokenizer file(s) {', '.join(missing)}; pass the complete model "
                            f"directory (the tokenizer is part of the model)")
    tc = read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").is_file() else {}
    separate = bool(tc.get("separate_vocabs", False))
    if separate and not (directory / "target_vocab.json").is_file():
        raise ImportRefused(f"{directory}: the tokenizer has separate vocabularies but target_vocab.json is missing")
    extra = tc.get("additional_special_tokens") or tc.get("extra_special_tokens") or []
    spec = {"source_spm": "source.spm", "target_spm": "target.spm", "vocab": "vocab.json",
            "target_vocab": "target_vocab.json" if separate else None,
            "eos": _token(tc.get("eos_token", "</s>")), "unk": _token(tc.get("unk_token", "<unk>")),
            "pad": _token(tc.get("pad_token", "<pad>")),
            "additional_special_tokens": [_token(t) for t in extra] if isinstance(extra, list) else [],
            "clean_up_tokenization_spaces": bool(tc.get("clean_up_tokenization_spaces", False))}
    try:
        tok = SentencePieceTokenizer(directory, spec)
    except TokenizerError as exc:
        raise ImportRefused(f"{directory}: {exc}") from None
    if tok.eos_id != config.eos_id or tok.pad_id != config.pad_id:
        raise ImportRefused(f"{directory}: the vocabulary's </s> and <pad> ids ({tok.eos_id}, {tok.pad_id}) differ "
                            f"from config.json's eos/pad ids ({config.eos_id}, {config.pad_id})")
    return tok


def _token(value) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def convert(directory: Path, options: ImportOptions) -> Converted:
    """The reference Transformer (eval mode) and SentencePieceTokenizer of a local Marian directory."""
    from toolkit.reference.model import Transformer

    hf = with_generation_config(directory, read_json(directory / "config.json"))
    if hf.get("model_type") != "marian":
        raise ImportRefused(f"{directory}/config.json has model_type {hf.get('model_type')!r}, not 'marian'")
    config = marian_model_config(hf, directory / "config.json")
    tokenizer = marian_tokenizer(directory, config)
    state = map_state(load_state(directory, options.progress), config, directory)
    expected = Transformer.empty(config).state_dict()
    for name, tensor in state.items():
        if name not in expected or tuple(expected[name].shape) != tuple(tensor.shape):
            want = tuple(expected[name].shape) if name in expected else "absent"
            raise ImportRefused(f"{directory}: weight for {name} has shape {tuple(tensor.shape)}, the config implies "
                                f"{want}; the weights do not match config.json")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ImportRefused(f"{directory}: no Marian weight maps to {', '.join(missing[:4])}")
    model = Transformer.from_state(config, state)
    record = {"files": sorted(p.name for p in directory.iterdir() if p.is_file())}
    return Converted(model.eval(), tokenizer, record)


def load_original(directory: Path):
    """(MarianMTModel in eval mode, MarianTokenizer) from a local directory: the reference of parity."""
    require_transformers("parity against a Marian directory")
    from transformers import MarianMTModel, MarianTokenizer

    tok = quiet_from_pretrained(MarianTokenizer.from_pretrained, directory)
    return quiet_from_pretrained(MarianMTModel.from_pretrained, directory).eval(), tok


FAMILY = register_family(Family(
    name="marian", source="a Marian (opus-mt) save_pretrained directory or hub name", convert=convert,
    model_types=("marian",), load_original=load_original, original="MarianMTModel (transformers)",
    hub_files=("*.json", "*.spm", "*.safetensors", "*.bin")))

__all__ = ["FAMILY", "convert", "load_original", "marian_model_config", "map_state", "map_embeddings",
           "marian_tokenizer"]
