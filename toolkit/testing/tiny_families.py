"""Tiny BART, mBART, M2M100 (NLLB) and Pegasus models and tokenizers made offline, for tests.

    tiny_original("m2m100", out_dir)     # a random M2M100ForConditionalGeneration saved with save_pretrained
    tiny_tokenizer("nllb")               # transformers' NllbTokenizer over a small BPE vocabulary
    trained_original("m2m100", out_dir)  # NLLB-style, trained briefly (eng_Latn -> deu_Latn), + tokenizer
    held_out(64)                         # sentences no training run saw (parity and gate inputs)

Random models come from their Config classes with weights large enough that greedy outputs vary with the input
(LayerNorm gains and biases, logits bias and learned positions included, so a swapped or dropped tensor shows).
Trained ones learn a word-by-word `translate` over whole-word tokenizers, as real models vary: by the input.
Tokenizers come from their classes over a small vocabulary (BPE for BART and NLLB, Unigram for mBART and
Pegasus); save_pretrained writes the tokenizer.json and tokenizer_config.json the importer reads. Needs
transformers (the `import` extra).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

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
                  vocab_size: int | None = None, forced_eos: bool = False):
    """A random transformers model of the family, saved in `directory`; forced EOS at the length limit is off
    unless `forced_eos` (forced_eos_token_id = eos, as BART, mBART and Pegasus configs have it).
    The default weights are large (varied outputs, but float32 rounding alone moves logits by ~1e-3); `matrix`
    CONDITIONED gives a model float32 computes as exactly as export's parity gate asks. `vocab_size` replaces
    SIZES' (a model imported with a tokenizer needs at least its tokens)."""
    import torch

    model = family_model(name, vocab_size or SIZES["vocab_size"], forced_eos)
    config = model.config
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
    model.save_pretrained(directory)
    return model


def family_model(name: str, vocab_size: int, forced_eos: bool = False):
    """The family's transformers model of SIZES (and `vocab_size`) with its own initialization, in eval mode;
    forced EOS is off in its config and generation config unless `forced_eos` (then the generation config's
    forced_eos_token_id is its eos). Callers set the weights."""
    import transformers

    config_cls, model_cls, overrides = FAMILIES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_cls)(**{**SIZES, "vocab_size": vocab_size}, **overrides)
        config.forced_eos_token_id = None              # generation settings live in generation_config.json
        model = getattr(transformers, model_cls)(config).eval()
    model.generation_config.forced_eos_token_id = config.eos_token_id if forced_eos else None
    return model


# the trained models: each family's tokenizer over whole words, a target language where the family has several
TRAINED_TOKENIZER = {"bart": "bart", "mbart": "mbart50", "m2m100": "nllb", "pegasus": "pegasus"}
LANGS = {"mbart50": ("en_XX", "de_DE"), "nllb": ("eng_Latn", "deu_Latn")}   # (source, target)
HELD_OUT_SEED = 1


def sentences(n: int, seed: int = 0) -> list[str]:
    """n sentences of 2-7 of WORDS at random."""
    import random

    rng = random.Random(seed)
    vocab = sorted(set(WORDS))
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(2, 7))) for _ in range(n)]


def held_out(n: int = 64, trained_on: int = 2000) -> list[str]:
    """n distinct sentences that none of the first `trained_on` training sentences (seed 0) equals."""
    seen, out = set(sentences(trained_on)), []
    for text in sentences(50 * n, HELD_OUT_SEED):
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out[:n]


def translate(text: str) -> str:
    """The trained models' task: each word replaced by its partner in a fixed permutation of WORDS, in order."""
    vocab = sorted(set(WORDS))
    partner = dict(zip(vocab, vocab[5:] + vocab[:5]))
    return " ".join(partner[w] for w in text.split())


def trainable(model, name: str, seed: int) -> None:
    """Weights a model of d_model 32 learns from in a few hundred steps: matrices N(0, 1/fan_in) (transformers'
    0.02 suits d_model 1024: here it starves the cross-attention), embeddings of unit size per dimension after
    the family's scaling, a small random logits bias (fixed: it is not trained); norms and biases as initialized."""
    import torch

    gen, d = torch.Generator().manual_seed(seed), model.config.d_model
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.dim() != 2 or (key.endswith("embed_positions.weight") and name == "pegasus"):
                continue                                         # Pegasus' table is its fixed sinusoids
            scaled = model.config.scale_embedding and "embed_positions" not in key
            std = (d ** -0.5 if scaled else 1.0) if "embed" in key or "shared" in key else p.shape[1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=gen) * 0.1)


TRAINED_STEPS = 600      # 300 left near-tied logits: int8 lost 3-4% of M2M100's tokens even with exact 8-bit sums


def trained_original(name: str, directory: str | Path, steps: int = TRAINED_STEPS, seed: int = 0, count: int = 2000,
                     lr: float = 3e-3, batch: int = 32):
    """(model, tokenizer): a transformers model of the family trained briefly (Adam, `steps` batches drawn from
    `count` sentences) to `translate` sentences of WORDS, and its tokenizer (whole words; NLLB and mBART-50 translate
    between the LANGS pair, the target being the language a caller forces first), both saved with save_pretrained
    in `directory`. Tens of seconds on one core.

    Why TRAINED_STEPS: after 300 steps the model trained on an AVX2 CPU (whose float sums differ from a VNNI CPU's,
    so training ends elsewhere) gave int8 96.1% of its fp32 greedy tokens with exact 8-bit arithmetic, under the
    98% row of the tolerance table: its logits were too close for any int8. After 600 all four families keep 100%
    with the int8 weights each CPU gets (benchmarks/RESULTS.md, "int8 on CPUs without VNNI"), and their outputs
    still vary (64 distinct of 64 held-out texts)."""
    import torch

    from toolkit.testing.tiny_marian import train_pairs

    source, target = LANGS.get(TRAINED_TOKENIZER[name], (None, None))
    tok = tiny_tokenizer(TRAINED_TOKENIZER[name], words=True, src_lang=source)
    if target is not None:
        tok.tgt_lang = target
    model = family_model(name, len(tok))
    trainable(model, name, seed)
    lines = sentences(count, seed)
    with torch.random.fork_rng():                      # dropout draws from torch's global generator: seeded here,
        torch.manual_seed(seed)                        # the same model whatever ran before in the process
        train_pairs(model, tok, lines, [translate(t) for t in lines], steps=steps, seed=seed, lr=lr, batch=batch,
                    warmup=steps // 10)
    model.eval().save_pretrained(directory)
    tok.save_pretrained(directory)
    return model, tok


class ForcedFirst:
    """An engine whose first step can only pick `token`: transformers' forced_bos_token_id, the same rule (every
    other logit -inf at the first step, so the token's log-probability is 0 and it counts in beam lengths and
    max_new_tokens), for comparing ids with `generate(forced_bos_token_id=token)`."""

    def __init__(self, engine, token: int):
        self.engine, self.token = engine, token

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def start(self, *args, **kwargs):
        return ForcedState(self.engine.start(*args, **kwargs), self.token)


class ForcedState:
    def __init__(self, state, token: int):
        self.state, self.token, self.steps = state, token, 0

    def step(self, tokens, keep):
        logits = self.state.step(tokens, keep)
        if self.steps == 0:
            logits[:] = -np.inf
            logits[:, self.token] = 0.0
        self.steps += 1
        return logits


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


def whole_words(vocab: dict[str, int], merges: list[tuple[str, str]], space: str) -> list[tuple[str, str]]:
    """`merges` and, after them, the merges that join each of WORDS (bare and after `space`) into one piece (each
    word's pieces under the merges so far, joined left to right: a later merge never splits an earlier word); the
    new pieces join vocab before <mask>, which stays last."""
    merges, mask = list(merges), vocab.pop("<mask>")
    for word in sorted(set(WORDS)):
        for form in (word, space + word):
            pieces = bpe_pieces(form, merges)
            while len(pieces) > 1:
                merges.append((pieces[0], pieces[1]))
                pieces = [pieces[0] + pieces[1], *pieces[2:]]
                vocab.setdefault(pieces[0], len(vocab))
    vocab["<mask>"] = max(mask, len(vocab))
    return merges


def bpe_pieces(word: str, merges: list[tuple[str, str]]) -> list[str]:
    """A word's BPE pieces: its letters, joined pair by pair, the best-ranked pair first."""
    rank = {pair: i for i, pair in enumerate(merges)}
    pieces = list(word)
    while True:
        pairs = [(rank[p], i) for i, p in enumerate(zip(pieces, pieces[1:])) if p in rank]
        if not pairs:
            return pieces
        _, i = min(pairs)
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]


def tiny_tokenizer(name: str, words: bool = False, src_lang: str | None = None, size: int | None = None):
    """transformers' tokenizer of the family (one of TOKENIZERS) over a small vocabulary; `words`: each of WORDS is
    one piece (short sequences a tiny model learns a task on in seconds), else they split into letters and pairs;
    src_lang: the source language of NLLB and mBART (default fra_Latn, de_DE); size: BART's vocabulary padded to it."""
    import transformers

    space = "\u0120" if name == "bart" else "\u2581"
    bpe, merges = bpe_vocab(space, size if name == "bart" else None)
    if words:
        merges = whole_words(bpe, merges, space)
    scored = [(piece, 0.0 if words and piece.strip(space) in WORDS else -float(i)) for piece, i in bpe.items()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "bart":
            return transformers.BartTokenizer(vocab=bpe, merges=merges)
        if name == "nllb":
            return transformers.NllbTokenizer(vocab=bpe, merges=merges, src_lang=src_lang or "fra_Latn")
        if name == "mbart":
            return transformers.MBartTokenizer(vocab=scored, src_lang=src_lang or "de_DE")
        if name == "mbart50":
            return transformers.MBart50Tokenizer(vocab=scored, src_lang=src_lang or "de_DE")
        if name == "pegasus":
            return transformers.PegasusTokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + scored[4:])
    raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")


MULTILINGUAL = {"nllb": "m2m100", "mbart50": "mbart"}   # tokenizer -> model family, target language forced


def tiny_multilingual(name: str, directory: str | Path, seed: int = 3, matrix: float = MATRIX):
    """(transformers model, tokenizer) of a tiny multilingual model (NLLB or mBART-50, MULTILINGUAL) saved together
    in `directory`, as `onnxformer import` reads them."""
    tokenizer = tiny_tokenizer(name)
    model = tiny_original(MULTILINGUAL[name], directory, seed=seed, matrix=matrix,
                          vocab_size=max(SIZES["vocab_size"], len(tokenizer)))
    tokenizer.save_pretrained(directory)
    return model, tokenizer



SHAPES = {   # real models' shapes, for benchmarks: (family, tokenizer, config beside the family's defaults)
    "nllb-600m": ("m2m100", "nllb", dict(vocab_size=256206, d_model=1024, encoder_layers=12, decoder_layers=12,
                                         encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
                                         decoder_ffn_dim=4096, max_position_embeddings=1024, scale_embedding=True,
                                         activation_function="relu", decoder_start_token_id=2)),
    "nllb-1.3b": ("m2m100", "nllb", dict(vocab_size=256206, d_model=1024, encoder_layers=24, decoder_layers=24,
                                         encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=8192,
                                         decoder_ffn_dim=8192, max_position_embeddings=1024, scale_embedding=True,
                                         activation_function="relu", decoder_start_token_id=2)),
    "nllb-3.3b": ("m2m100", "nllb", dict(vocab_size=256206, d_model=2048, encoder_layers=24, decoder_layers=24,
                                         encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=8192,
                                         decoder_ffn_dim=8192, max_position_embeddings=1024, scale_embedding=True,
                                         activation_function="relu", decoder_start_token_id=2)),
    "mbart-large-50": ("mbart", "mbart50", dict(vocab_size=250054, d_model=1024, encoder_layers=12, decoder_layers=12,
                                                encoder_attention_heads=16, decoder_attention_heads=16,
                                                encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                                                max_position_embeddings=1024, scale_embedding=True,
                                                activation_function="gelu", decoder_start_token_id=2)),
    "pegasus-large": ("pegasus", "pegasus", dict(vocab_size=96103, d_model=1024, encoder_layers=16, decoder_layers=16,
                                                 encoder_attention_heads=16, decoder_attention_heads=16,
                                                 encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                                                 max_position_embeddings=1024, scale_embedding=True,
                                                 activation_function="relu")),
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
    tiny_tokenizer(tokenizer, size=config["vocab_size"]).save_pretrained(directory)
    return Path(directory)



__all__ = ["CONDITIONED", "FAMILIES", "SHAPES", "SIZES", "ForcedFirst", "LANGS", "MULTILINGUAL", "TOKENIZERS",
           "TRAINED_TOKENIZER", "family_model", "held_out", "random_original", "sentences", "tiny_multilingual",
           "tiny_original", "tiny_tokenizer", "trained_original", "TRAINED_STEPS", "translate"]
