"""Tiny BART, mBART, M2M100 (NLLB) and Pegasus models and tokenizers made offline, for tests.

    tiny_original("m2m100", out_dir)    # a random M2M100ForConditionalGeneration saved with save_pretrained
    tiny_tokenizer("nllb")              # transformers' NllbTokenizer over a small BPE vocabulary

Models come from their Config classes with random weights large enough that greedy outputs vary with the input
(LayerNorm gains and biases, logits bias and learned positions included, so a swapped or dropped tensor shows).
Tokenizers come from their classes over a small vocabulary (BPE for BART and NLLB, Unigram for mBART and
Pegasus); save_pretrained writes the tokenizer.json and tokenizer_config.json the importer reads. Needs
transformers (the `import` extra).
"""

from __future__ import annotations

import warnings
from pathlib import Path

SIZES = dict(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=48,
             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
FAMILIES = {   # name: (Config class, model class, config overrides beside SIZES)
    "bart": ("BartConfig", "BartForConditionalGeneration", {}),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", dict(decoder_start_token_id=2, scale_embedding=True)),
    "m2m100": ("M2M100Config", "M2M100ForConditionalGeneration", {}),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration",
                dict(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, scale_embedding=True)),
}
MATRIX, EMBED = 1.0, 1.2   # weight scales: large enough that random models answer differently per input
CONDITIONED = 0.3          # a matrix scale whose float32 logits stay well within export's parity gate (1e-4)
TOKENIZERS = ("bart", "nllb", "mbart", "mbart50", "pegasus")
WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex a jolly box".split()


def tiny_original(name: str, directory: str | Path, seed: int = 0, matrix: float = MATRIX,
                  vocab_size: int | None = None):
    """A random transformers model of the family, saved in `directory`; forced EOS is off (the runtime has none).
    The default weights are large (varied outputs, but float32 rounding alone moves logits by ~1e-3); `matrix`
    CONDITIONED gives a model float32 computes as exactly as export's parity gate asks. `vocab_size` replaces
    SIZES' (a model imported with a tokenizer needs at least its tokens)."""
    import torch
    import transformers

    config_cls, model_cls, overrides = FAMILIES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_cls)(**{**SIZES, "vocab_size": vocab_size or SIZES["vocab_size"]},
                                                   **overrides)
        config.forced_eos_token_id = None
        model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    embed = EMBED / (config.d_model ** 0.5 if config.scale_embedding else 1.0)   # scaled or not: O(1) inputs
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("embed_positions.weight") and name == "pegasus":
                continue                                         # Pegasus' table is its fixed sinusoids
            scale = 0.1 if key.endswith("bias") else embed if "embed" in key or "shared" in key else matrix
            gain = 1.0 if "norm" in key and key.endswith("weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * scale + gain)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=gen))
    model.generation_config.forced_eos_token_id = None
    model.save_pretrained(directory)
    return model


def bpe_vocab(space: str, size: int | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small BPE vocabulary (<s> <pad> </s> <unk> first, <mask> last) and its merges; `size`: padded with
    made-up pieces to that many entries (a real model's vocabulary size, for converters that want one token per
    embedding row)."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for ch in sorted(set("".join(WORDS)) | {space}):
        vocab.setdefault(ch, len(vocab))
    merges = [("t", "h"), ("th", "e"), (space, "t"), ("o", "x"), ("q", "u"), ("e", "r"), ("j", "o")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    while len(vocab) < (size or 0) - 1:
        vocab[f"{space}w{len(vocab)}"] = len(vocab)
    vocab["<mask>"] = len(vocab)
    return vocab, merges


def tiny_tokenizer(name: str, size: int | None = None):
    """transformers' tokenizer of the family (one of TOKENIZERS) over a small vocabulary (BART's padded to `size`)."""
    import transformers

    bpe, merges = bpe_vocab("\u0120" if name == "bart" else "\u2581", size if name == "bart" else None)
    scored = [(piece, -float(i)) for piece, i in bpe.items()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "bart":
            return transformers.BartTokenizer(vocab=bpe, merges=merges)
        if name == "nllb":
            return transformers.NllbTokenizer(vocab=bpe, merges=merges, src_lang="fra_Latn")
        if name == "mbart":
            return transformers.MBartTokenizer(vocab=scored, src_lang="de_DE")
        if name == "mbart50":
            return transformers.MBart50Tokenizer(vocab=scored, src_lang="de_DE")
        if name == "pegasus":
            return transformers.PegasusTokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + scored[4:])
    raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")


SHAPES = {   # real models' shapes, for benchmarks: (family, tokenizer, config beside the family's defaults)
    "nllb-600m": ("m2m100", "nllb", dict(vocab_size=256206, d_model=1024, encoder_layers=12, decoder_layers=12,
                                         encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
                                         decoder_ffn_dim=4096, max_position_embeddings=1024, scale_embedding=True,
                                         activation_function="relu", decoder_start_token_id=2)),
    "bart-base": ("bart", "bart", dict(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6,
                                       encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
                                       decoder_ffn_dim=3072, max_position_embeddings=1024,
                                       normalize_before=False)),    # BART is post-norm: CTranslate2 reads this key
}


def random_original(shape: str, directory: str | Path, seed: int = 0) -> Path:
    """A save_pretrained directory of a real model's shape (one of SHAPES) with transformers' own random
    initialization and the family's tokenizer over the small vocabulary (BART's padded with made-up pieces to the
    model's size, as CTranslate2's converter wants; NLLB's padded by that converter itself): for speed and memory
    benchmarks."""
    import torch
    import transformers

    name, tokenizer, config = SHAPES[shape]
    config_cls, model_cls, _ = FAMILIES[name]
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = getattr(transformers, config_cls)(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **config)
        cfg.forced_eos_token_id = None
        model = getattr(transformers, model_cls)(cfg).eval()
    model.generation_config.forced_eos_token_id = None
    model.save_pretrained(directory)
    tiny_tokenizer(tokenizer, config["vocab_size"]).save_pretrained(directory)
    return Path(directory)


__all__ = ["CONDITIONED", "FAMILIES", "SHAPES", "SIZES", "TOKENIZERS", "random_original", "tiny_original",
           "tiny_tokenizer"]
