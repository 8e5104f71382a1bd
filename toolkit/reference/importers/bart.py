"""Hugging Face BART and its family (mBART, M2M100 / NLLB, Pegasus) -> the reference model.

Each family is the paper's Transformer with variants, all set in the imported ModelConfig:

    family    norm  positions (ours)                          embedding LayerNorm  logits bias  decoder start
    bart      post  learned, offset 2        -> "table"       yes                  yes          eos
    mbart     pre   learned, offset 2        -> "table"       yes                  yes          config's
    m2m_100   pre   fairseq sin|cos, past pad -> "table"      no                   no           eos
    pegasus   pre   sin|cos halves           -> "halves"      no                   yes          pad

Pre-norm stacks end with a LayerNorm (encoder.layer_norm, decoder.layer_norm), as ours do; FFN activations,
embedding scale (scale_embedding), tied output matrix and ids come from config.json. A learned table keeps the
rows the original reads (position p reads row p + offset), so positions 0..max_len-1 are exactly the original's.
Every tensor of the checkpoint must be used (toolkit/reference/importers/marian.py's map_state maps the shared
layer names), so a feature the reference model lacks is refused by name, never dropped.

    model = convert_state(BART, hf_config_dict, state_dict)  # a Transformer in eval mode
    model = load_family(directory)                          # config.json + model.safetensors / pytorch_model.bin
    tokenizer = family_tokenizer(directory, model.config)   # runtime.tokenizer.FastTokenizer, or None
    FAMILY = register_family(family(BART, "bart", "..."))   # `onnxformer import` reads the model_type's directories

Each model_type is one family of the importer registry (this module and mbart.py, m2m100.py, pegasus.py):
convert_directory is its convert (both of the above), load_original loads the transformers original for parity.

How each tokenizer frames a source is data (FRAMINGS): "{bos}" and "{eos}" are resolved here from
tokenizer_config.json, "{src_lang}" is kept for the runtime tokenizer, which puts spec["src_lang"] there. A
multilingual tokenizer's codes (LANGUAGES: its special tokens shaped like the family's codes) and the tokens forced
after the decoder start ("{tgt_lang}": the target language, chosen per request) are recorded in its spec as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.reference.config import ModelConfig
from toolkit.reference.importers.marian import ACTIVATIONS, _token, load_state, map_state
from toolkit.reference.importers.registry import Converted, Family, ImportOptions, ImportRefused, register_family
from toolkit.reference.importers.sources import (forced_eos, model_of, one_eos, quiet_from_pretrained, read_json,
                                                 require_transformers, with_generation_config)

if TYPE_CHECKING:
    import torch

REQUIRED = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
            "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings",
            "activation_function", "scale_embedding", "pad_token_id", "eos_token_id")


@dataclass(frozen=True)
class Architecture:
    """What a model_type's architecture fixes (its config.json cannot switch these)."""

    model_type: str          # config.json's model_type
    title: str               # the transformers class, for messages
    norm: str                # "post" or "pre" (pre-norm stacks end with a LayerNorm)
    positions: str           # "learned" (offset rows dropped), "fairseq" (sinusoids past the pad id), "halves"
    layernorm_embedding: bool
    logits_bias: bool        # final_logits_bias


BART = Architecture("bart", "BartForConditionalGeneration", "post", "learned", True, True)
LEARNED_OFFSET = 2           # BART-family learned tables start with two unused rows
# what a hub download fetches: config, generation and tokenizer JSON, the weights (safetensors, else the .bin)
HUB_FILES = ("*.json", "*.safetensors", "pytorch_model.bin")


def model_config(arch: Architecture, hf: dict, where: Path) -> ModelConfig:
    """The ModelConfig of a family's config.json, refusing by name what the reference model cannot represent."""
    missing = [k for k in REQUIRED if k not in hf]
    if missing:
        raise ImportRefused(f"{where} lacks {', '.join(missing)}; save the model again with save_pretrained")
    act = hf["activation_function"]
    if act not in ACTIVATIONS:
        raise ImportRefused(f"{where}: activation {act!r} cannot be represented (supported: "
                            f"{', '.join(sorted(ACTIVATIONS))})")
    for what, (a, b) in {"attention heads": ("encoder_attention_heads", "decoder_attention_heads"),
                         "feed-forward sizes": ("encoder_ffn_dim", "decoder_ffn_dim")}.items():
        if hf[a] != hf[b]:
            raise ImportRefused(f"{where}: encoder and decoder have different {what} ({hf[a]} vs {hf[b]}); "
                                f"the reference model has one value for both")
    eos, pad = hf["eos_token_id"], hf["pad_token_id"]
    eos = one_eos(eos, where)
    start = hf.get("decoder_start_token_id")
    if start is None:
        raise ImportRefused(f"{where} has no decoder_start_token_id; set it (mBART-50 and NLLB start from eos, "
                            f"{eos}) and import again")
    if arch.positions == "fairseq" and (pad is None or not isinstance(hf["d_model"], int) or hf["d_model"] < 4):
        raise ImportRefused(f"{where}: fairseq positions need pad_token_id (they are counted past it) and d_model of "
                            f"at least 4, got {pad} and {hf['d_model']}")
    fields = dict(vocab_size=hf["vocab_size"], d_model=hf["d_model"], n_heads=hf["encoder_attention_heads"],
                  n_encoder_layers=hf["encoder_layers"], n_decoder_layers=hf["decoder_layers"],
                  d_ff=hf["encoder_ffn_dim"], max_len=hf["max_position_embeddings"],
                  dropout=float(hf.get("dropout", 0.1)), norm=arch.norm, activation=ACTIVATIONS[act],
                  tie_embeddings=bool(hf.get("tie_word_embeddings", True)), layer_norm_eps=1e-5,
                  pad_id=pad, bos_id=start, eos_id=eos,
                  positions="halves" if arch.positions == "halves" else "table",
                  scale_embeddings=bool(hf["scale_embedding"]), logits_bias=arch.logits_bias,
                  layernorm_embedding=arch.layernorm_embedding, forced_eos=forced_eos(hf, eos, where),
                  suppress_pad=start == pad)          # decoding from pad (Pegasus) never generates pad, as Marian
    try:
        return ModelConfig(**fields)
    except Exception as exc:
        raise ImportRefused(f"{where}: the config cannot be represented ({exc})") from None


def fairseq_table(config: ModelConfig) -> torch.Tensor:
    """[max_len, d] fairseq sinusoids as M2M100 computes them (float32, sin | cos halves, frequencies spaced
    1/(half-1)): position p reads row p + pad_id + 1 of fairseq's table."""
    import torch

    half = config.d_model // 2
    freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
    rows = torch.arange(config.pad_id + 1, config.pad_id + 1 + config.max_len, dtype=torch.int64).float()
    angle = rows.unsqueeze(1) * freq.unsqueeze(0)
    table = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)
    return torch.cat([table, torch.zeros(config.max_len, 1)], dim=1) if config.d_model % 2 else table


def take_positions(arch: Architecture, state: dict, config: ModelConfig, where: Path) -> dict[str, torch.Tensor]:
    """Each side's position table, popped from `state` (ours: pos.pe is the decoder's, src_pos.pe the encoder's)."""
    import torch

    from toolkit.reference.model import sinusoid_table

    tables = {side: state.pop(f"{side}.embed_positions.weight", None) for side in ("encoder", "decoder")}
    if arch.positions == "fairseq":
        if any(t is not None for t in tables.values()):
            raise ImportRefused(f"{where}: the weights carry a learned position table; {arch.title} computes "
                                f"its sinusoids, so this checkpoint is not one")
        table = fairseq_table(config)
        rows = slice(config.pad_id + 1, config.pad_id + 1 + config.max_len)
        for side in ("encoder", "decoder"):           # older checkpoints saved the computed table: it must agree
            got = state.pop(f"{side}.embed_positions.weights", None)
            if got is not None and (got.shape[0] < rows.stop or got.shape[1:] != table.shape[1:] or
                                    not torch.allclose(got[rows].float(), table, atol=1e-6, rtol=0)):
                raise ImportRefused(f"{where}: {side}.embed_positions.weights is not {arch.title}'s sinusoid "
                                    f"table; other positions cannot be represented")
        return {"src_pos.pe": table, "pos.pe": table.clone()}
    if arch.positions == "halves":
        want = sinusoid_table(config)
        for side, got in tables.items():
            if got is not None and (got.shape != want.shape or not torch.allclose(got.float(), want, atol=1e-6,
                                                                                   rtol=0)):
                raise ImportRefused(f"{where}: {side}.embed_positions.weight is not the sin|cos sinusoid table "
                                    f"{arch.title} uses; learned positions cannot be represented here")
        return {}
    out = {}
    for side, ours in (("encoder", "src_pos.pe"), ("decoder", "pos.pe")):
        got = tables[side]
        if got is None or tuple(got.shape) != (config.max_len + LEARNED_OFFSET, config.d_model):
            shape = "missing" if got is None else f"of shape {tuple(got.shape)}"
            raise ImportRefused(f"{where}: {side}.embed_positions.weight is {shape}; {arch.title} needs "
                                f"[max_position_embeddings + {LEARNED_OFFSET}, d_model]")
        out[ours] = got[LEARNED_OFFSET:]
    return out


def take_norms(arch: Architecture, state: dict, config: ModelConfig, where: Path) -> dict[str, torch.Tensor]:
    """The embedding LayerNorms and the final stack LayerNorms, popped from `state`; a family that has them must
    carry them, one that lacks them must not (a checkpoint that disagrees with its model_type is refused)."""
    wanted = {}
    for side, ours in (("encoder", "src_pos"), ("decoder", "pos")):
        wanted[f"{side}.layernorm_embedding"] = (f"{ours}.norm", arch.layernorm_embedding,
                                                 "an embedding LayerNorm (layernorm_embedding)")
        wanted[f"{side}.layer_norm"] = (f"{side}.norm", config.norm == "pre", "a final stack LayerNorm (layer_norm)")
    out = {}
    for theirs, (ours, expected, feature) in wanted.items():
        for kind in ("weight", "bias"):
            got = state.pop(f"{theirs}.{kind}", None)
            if (got is not None) != expected:
                verb = "lacks" if expected else "has"
                raise ImportRefused(f"{where}: the weights {verb} {theirs}.{kind}, but {arch.title} "
                                    f"{'has' if expected else 'lacks'} {feature}; the checkpoint is not a "
                                    f"{arch.title}")
            if got is not None:
                out[f"{ours}.{kind}"] = got
    return out


def convert_state(arch: Architecture, hf: dict, state: dict[str, torch.Tensor], where: Path = Path("config.json")):
    """The reference Transformer (eval mode) holding a family checkpoint's weights: config.json as a dict and the
    state dict of its *ForConditionalGeneration (keys with or without the "model." prefix)."""
    if hf.get("model_type") != arch.model_type:
        raise ImportRefused(f"{where} has model_type {hf.get('model_type')!r}, not {arch.model_type!r}")
    config = model_config(arch, hf, where)
    state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    extra = {**take_positions(arch, state, config, where), **take_norms(arch, state, config, where)}
    if not arch.logits_bias and "final_logits_bias" in state:
        raise ImportRefused(f"{where}: the weights have final_logits_bias, which {arch.title} lacks")
    mapped = map_state(state, config, where)          # embeddings, output matrix, logits bias, every layer
    if not arch.logits_bias:
        mapped.pop("generator.bias")                  # map_state's zeros: this family has no bias
    mapped.update(extra)                              # from_state makes every tensor float32 and contiguous
    return model_of(config, mapped, where)


def load_family(directory: str | Path, arch: Architecture | None = None, progress=None):
    """The reference Transformer of a save_pretrained directory of any family here (from its model_type)."""
    directory = Path(directory)
    hf = read_json(directory / "config.json")
    if arch is None:
        arch = architecture_of(hf, directory / "config.json")
    hf = with_generation_config(directory, hf)
    state = load_state(directory, progress or (lambda msg: None))
    return convert_state(arch, hf, state, directory / "config.json")


FRAMINGS = {   # tokenizer_config.json's tokenizer_class (without "Fast") -> (source prefix, suffix, default src_lang)
    "BartTokenizer": (["{bos}"], ["{eos}"], None),
    "RobertaTokenizer": (["{bos}"], ["{eos}"], None),                     # what BartTokenizer saves as
    "PegasusTokenizer": ([], ["{eos}"], None),
    "NllbTokenizer": (["{src_lang}"], ["{eos}"], "eng_Latn"),
    "NllbTokenizer legacy": ([], ["{eos}", "{src_lang}"], "eng_Latn"),   # legacy_behaviour true
    "MBartTokenizer": ([], ["{eos}", "{src_lang}"], "en_XX"),             # mbart-large-cc25
    "MBart50Tokenizer": (["{src_lang}"], ["{eos}"], "en_XX"),
    "T5Tokenizer": ([], ["{eos}"], None),                                  # t5, v1.1, Flan-T5 (t5.py)
    "MT5Tokenizer": ([], ["{eos}"], None),                                 # what older mT5 configs name
}
LANGUAGES = {  # tokenizer class -> (what its language codes look like, the tokens forced after the decoder start)
    "NllbTokenizer": (r"[a-z]{3}_[A-Z][a-z]{3}", ["{tgt_lang}"]),           # eng_Latn; forced_bos_token_id
    "MBart50Tokenizer": (r"[a-z]{2}_[A-Z]{2}", ["{tgt_lang}"]),             # en_XX; forced_bos_token_id
    "MBartTokenizer": (r"[a-z]{2}_[A-Z]{2}", None),   # cc25: its decoder start is the target language, fixed
}
TOKENIZER_OF = {"bart": "BartTokenizer", "mbart": "MBartTokenizer", "pegasus": "PegasusTokenizer",
                "m2m_100": "NllbTokenizer", "t5": "T5Tokenizer", "mt5": "T5Tokenizer"}   # when tokenizer_config.json
                                                                                        # names no tokenizer_class


def family_tokenizer(directory: Path, config: ModelConfig, files: Path | None = None):
    """The runtime FastTokenizer of a directory's tokenizer.json and tokenizer_config.json (in `files` where they
    were written elsewhere: a SentencePiece model converted at import); None without a tokenizer.json (the model is
    then used with ids)."""
    from runtime.errors import TokenizerError
    from runtime.tokenizer import FastTokenizer

    model_dir, directory = Path(directory), Path(files or directory)
    if not (directory / "tokenizer.json").is_file():
        return None
    tc = read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").is_file() else {}
    model_type = None if tc.get("tokenizer_class") else read_json(model_dir / "config.json").get("model_type")
    cls = str(tc.get("tokenizer_class") or TOKENIZER_OF.get(model_type, "")).removesuffix("Fast")
    key = f"{cls} legacy" if cls == "NllbTokenizer" and tc.get("legacy_behaviour") else cls
    if key not in FRAMINGS:
        raise ImportRefused(f"{directory}/tokenizer_config.json names tokenizer_class {tc.get('tokenizer_class')!r}, "
                            f"whose source framing is unknown (known: {', '.join(sorted(FRAMINGS))})")
    prefix, suffix, default_lang = FRAMINGS[key]
    names = {"{bos}": _token(tc.get("bos_token", "<s>")), "{eos}": _token(tc.get("eos_token", "</s>"))}
    spec = {"file": "hf_tokenizer.json.gz", "source_prefix": [names.get(t, t) for t in prefix],
            "source_suffix": [names.get(t, t) for t in suffix], "src_lang": tc.get("src_lang") or default_lang,
            "eos": names["{eos}"], "pad": _token(tc.get("pad_token", "<pad>")),
            "clean_up_tokenization_spaces": bool(tc.get("clean_up_tokenization_spaces", False))}
    try:                                                  # saved beside our tokenizer.json as spec["file"]
        tok = FastTokenizer(directory, spec, source=directory / "tokenizer.json")
        if cls in LANGUAGES:
            tok = FastTokenizer(directory, {**spec, **language_spec(tok, *LANGUAGES[cls])}, tok.source)
    except TokenizerError as exc:
        raise ImportRefused(f"{directory}: {exc}") from None
    if (tok.eos_id, tok.pad_id) != (config.eos_id, config.pad_id):
        raise ImportRefused(f"{directory}: the tokenizer's eos and pad ids ({tok.eos_id}, {tok.pad_id}) differ from "
                            f"config.json's ({config.eos_id}, {config.pad_id})")
    return tok


def language_spec(tok, pattern: str, target_start: list[str] | None) -> dict:
    """The tokenizer spec's languages: the special tokens shaped like the family's codes (in id order) and, where
    the target language is chosen per request, the tokens forced after the decoder start."""
    import re

    codes = [t for t in tok.special_tokens() if re.fullmatch(pattern, t)]
    return {"languages": codes, **({"target_start": target_start} if target_start and codes else {})}


def architectures() -> dict[str, Architecture]:
    """model_type -> Architecture of every registered family that converts with this module (made by `family`):
    the registry is the one table of families, this reads it."""
    from toolkit.reference.importers.registry import families

    converts = [f.convert for f in families().values()]
    return {c.args[0].model_type: c.args[0] for c in converts
            if isinstance(c, partial) and c.func is convert_directory}


def architecture_of(hf: dict, where: Path) -> Architecture:
    known = architectures()
    if hf.get("model_type") not in known:
        raise ImportRefused(f"{where} has model_type {hf.get('model_type')!r}; this importer reads "
                            f"{', '.join(known)}")
    return known[hf["model_type"]]


def convert_directory(arch: Architecture, directory: Path, options: ImportOptions) -> Converted:
    """A family's registry convert: the reference Transformer and FastTokenizer (or None) of a local directory."""
    model = load_family(directory, arch, options.progress)
    tokenizer = family_tokenizer(directory, model.config)
    if tokenizer is None:
        options.progress(f"{directory} has no tokenizer.json: the checkpoint takes token ids only")
    return Converted(model, tokenizer, {"files": sorted(p.name for p in directory.iterdir() if p.is_file())})


def load_original(arch: Architecture, directory: Path):
    """(the transformers model of the architecture in eval mode, its tokenizer) from a local directory: the
    reference of parity."""
    transformers = require_transformers(f"parity against a {arch.title} directory")
    model = quiet_from_pretrained(getattr(transformers, arch.title).from_pretrained, directory).eval()
    return model, quiet_from_pretrained(transformers.AutoTokenizer.from_pretrained, directory)


def family(arch: Architecture, name: str, source: str) -> Family:
    """The importer registry's Family of an architecture (register it with register_family)."""
    return Family(name=name, source=source, convert=partial(convert_directory, arch), model_types=(arch.model_type,),
                  load_original=partial(load_original, arch), original=f"{arch.title} (transformers)",
                  hub_files=HUB_FILES)


FAMILY = register_family(family(BART, "bart", "a BART save_pretrained directory or hub name"))

__all__ = ["BART", "FAMILY", "FRAMINGS", "LANGUAGES", "Architecture", "architectures", "convert_directory",
           "convert_state", "fairseq_table", "family", "family_tokenizer", "language_spec", "load_family",
           "load_original", "model_config"]
