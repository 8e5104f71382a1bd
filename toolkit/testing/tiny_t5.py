"""Tiny T5 models (t5, T5 v1.1 / Flan-T5, mT5, ByT5) and their tokenizers made offline, for tests.

    random_t5("v1.1", out_dir)       # (transformers model, tokenizer) with random weights, saved with save_pretrained
    random_shape("t5-small", out_dir)  # a real checkpoint's shape (SHAPES), transformers' own init, for benchmarks
    trained_t5("byt5", out_dir)      # the same, trained briefly on tiny_families.translate (outputs vary by input)

    variant   model class                     feed_forward_proj  head                 tokenizer files
    t5        T5ForConditionalGeneration      relu               tied, rescaled       tokenizer.json (T5Tokenizer)
    v1.1      T5ForConditionalGeneration      gated-gelu         untied lm_head       tokenizer.json (T5Tokenizer)
    mt5       MT5ForConditionalGeneration     gated-gelu         untied; d_kv * heads != d_model   spiece.model only
    byt5      T5ForConditionalGeneration      gated-gelu         untied               none: ByT5Tokenizer's bytes

Each variant has its own relative-position buckets and distance, small enough that the inputs here reach the
logarithmic buckets. transformers 5 always ties a new T5's head (its config keeps only whether to rescale): an
untied variant gets a head of its own before training and a config.json as the hub's v1.1 files have it
(tie_word_embeddings false), which transformers loads untied. Needs transformers and sentencepiece.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

SIZES = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
             pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, n_positions=64)
VARIANTS = {   # name: (config class, model class, config beside SIZES, tokenizer kind)
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(feed_forward_proj="relu"), "words"),
    "v1.1": ("T5Config", "T5ForConditionalGeneration",
             dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=8,
                  relative_attention_max_distance=20), "words"),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration",
            dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, d_kv=6, relative_attention_num_buckets=16,
                 relative_attention_max_distance=32), "spiece"),
    "byt5": ("T5Config", "T5ForConditionalGeneration",
             dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=16,
                  relative_attention_max_distance=64, n_positions=128), "bytes"),
}
EXTRA_IDS = 3              # sentinels <extra_id_N> of the word tokenizers (T5 has 100, ByT5 125)


def words_tokenizer(pieces: int = 0, extra_ids: int = EXTRA_IDS):
    """transformers' T5Tokenizer over whole words of tiny_families.WORDS (plus letters), its `extra_ids` sentinels
    last; `pieces`: padded with made-up words to that many pieces (the real checkpoints' 32,000, so that the
    tokenizer has their size, as CTranslate2's converter lists the model's rows from it)."""
    import transformers

    from toolkit.testing.tiny_families import WORDS

    letters = sorted(set("".join(WORDS)))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -5.0) for c in letters] + [("\u2581" + w, 0.0) for w in sorted(set(WORDS))]
    vocab += [(f"\u2581w{i}", -10.0) for i in range(len(vocab), pieces)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.T5Tokenizer(vocab=vocab, extra_ids=extra_ids)


def spiece_tokenizer(directory: Path):
    """A SentencePiece unigram model trained on tiny_families sentences, written as directory/spiece.model (T5's
    ids: <pad> 0, </s> 1, <unk> 2) with a tokenizer_config.json and no tokenizer.json; transformers' T5Tokenizer of
    it."""
    import sentencepiece as spm
    import transformers

    from toolkit.testing.tiny_families import sentences

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences(500)), model_writer=buf, vocab_size=40,
                                   model_type="unigram", character_coverage=1.0, pad_id=0, eos_id=1, unk_id=2,
                                   bos_id=-1, minloglevel=2, num_threads=1)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "spiece.model").write_bytes(buf.getvalue())
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 0}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.T5Tokenizer.from_pretrained(str(directory))


def variant_tokenizer(name: str, directory: Path):
    """The variant's transformers tokenizer; the spiece variant writes its files into directory already."""
    import transformers

    kind = VARIANTS[name][3]
    if kind == "spiece":
        return spiece_tokenizer(directory)
    return words_tokenizer() if kind == "words" else transformers.ByT5Tokenizer()


def variant_model(name: str, vocab_size: int, seed: int):
    """The variant's transformers model (eval mode), weights drawn from `seed` at unit scale per fan-in (a tiny
    model learns from them in a few hundred steps), its own head where the variant is untied."""
    import torch
    import transformers

    config_cls, model_cls, overrides, _ = VARIANTS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_cls)(vocab_size=vocab_size, **{**SIZES, **overrides})
        model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if overrides.get("tie_word_embeddings") is False:
            model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
        for key, p in model.named_parameters():
            if p.dim() == 2:
                std = 1.0 if key == "shared.weight" or "relative_attention_bias" in key else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def save_variant(name: str, model, tok, directory: Path) -> None:
    """save_pretrained of model and tokenizer; an untied variant's config.json as the hub's (tie_word_embeddings
    false, nothing else about the head), its lm_head.weight kept."""
    from safetensors.torch import load_file

    model.save_pretrained(directory)
    if VARIANTS[name][3] != "spiece":
        tok.save_pretrained(directory)
    if VARIANTS[name][2].get("tie_word_embeddings") is False:
        config = json.loads((directory / "config.json").read_text())
        config.pop("scale_decoder_outputs", None)
        (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
        if "lm_head.weight" not in load_file(directory / "model.safetensors"):
            raise RuntimeError(f"save_pretrained dropped the untied lm_head.weight of {name}")


def load_variant(name: str, directory: Path):
    """(transformers model in eval mode, tokenizer) read back from directory, as parity reads them."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.utils import logging
        logging.set_verbosity_error()
        model = getattr(transformers, VARIANTS[name][1]).from_pretrained(str(directory)).eval()
        return model, transformers.AutoTokenizer.from_pretrained(str(directory))


def random_t5(name: str, directory: str | Path, seed: int = 0, extra_rows: int = 0):
    """(model, tokenizer): a variant with random weights saved in directory (and read back); extra_rows: model
    rows past the tokenizer's last token (T5's checkpoints: vocab_size 32128 for 32100 tokens)."""
    directory = Path(directory)
    tok = variant_tokenizer(name, directory)
    save_variant(name, variant_model(name, len(tok) + extra_rows, seed), tok, directory)
    return load_variant(name, directory)


TRAINED_STEPS = 300


def trained_t5(name: str, directory: str | Path, steps: int = TRAINED_STEPS, seed: int = 0, count: int = 2000,
               lr: float = 3e-3, batch: int = 32, prefix: str = ""):
    """(model, tokenizer): a variant trained briefly (Adam, `steps` batches of `count` sentences) on
    tiny_families.translate, saved in directory and read back. Seconds per variant on one core. prefix: a task
    prefix every source starts with, as T5's tasks are named ("translate English to German: ...")."""
    import torch

    from toolkit.testing.tiny_families import sentences, translate
    from toolkit.testing.tiny_marian import train_pairs

    directory = Path(directory)
    tok = variant_tokenizer(name, directory)
    model = variant_model(name, len(tok), seed)
    lines = sentences(count, seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        train_pairs(model, tok, [prefix + t for t in lines], [translate(t) for t in lines], steps=steps, seed=seed,
                    lr=lr, batch=batch, warmup=steps // 10)
    save_variant(name, model.eval(), tok, directory)
    return load_variant(name, directory)


SHAPES = {   # real checkpoints' shapes, for benchmarks: (variant, config replacing SIZES)
    "t5-small": ("t5", dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8)),
    "flan-t5-base": ("v1.1", dict(d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12,
                                  num_heads=12)),
}
SHAPE_PIECES, SHAPE_EXTRA_IDS, SHAPE_ROWS = 32000, 100, 32128   # the checkpoints' tokenizer and embedding rows


def random_shape(shape: str, directory: str | Path, seed: int = 0) -> Path:
    """A save_pretrained directory of a real checkpoint's shape (one of SHAPES: t5-small, ReLU, tied head;
    flan-t5-base, gated-GELU, its own head), 32,128 embedding rows for a 32,100-token tokenizer as the hub's, with
    transformers' own random initialization: for speed and memory benchmarks, not tokens. The untied head is drawn
    N(0, 1 / d_model), the scale of the tied head after its rescale: transformers' N(0, 1) gives flan-t5-base logits
    of std 21, where float32 rounding alone (relative 1.5e-6) breaks export's absolute 1e-4 logits gate."""
    import torch
    import transformers

    name, sizes = SHAPES[shape]
    config_cls, model_cls, overrides, _ = VARIANTS[name]
    defaults = {k: v for k, v in overrides.items() if k in ("feed_forward_proj", "tie_word_embeddings")}
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_cls)(vocab_size=SHAPE_ROWS, dropout_rate=0.0, pad_token_id=0,
                                                   eos_token_id=1, decoder_start_token_id=0, **defaults, **sizes)
        model = getattr(transformers, model_cls)(config).eval()
    if defaults.get("tie_word_embeddings") is False:
        with torch.no_grad():
            head = torch.randn(model.lm_head.weight.shape) * config.d_model ** -0.5
            model.lm_head.weight = torch.nn.Parameter(head)
    directory = Path(directory)
    save_variant(name, model, words_tokenizer(SHAPE_PIECES, SHAPE_EXTRA_IDS), directory)
    return directory


__all__ = ["SHAPES", "SIZES", "TRAINED_STEPS", "VARIANTS", "load_variant", "random_shape", "random_t5",
           "trained_t5", "variant_model", "variant_tokenizer"]
