"""A small Marian (opus-mt-style) model made offline: tests, the examples/marian walk-through, benchmarks.

    build_tiny_marian(out_dir)              # SentencePiece models trained on a generated corpus, a MarianMTModel
                                            # trained briefly on it (word order reversed), saved with save_pretrained
    build_tiny_marian(out_dir, **TRAINED)   # a realistic one (syllable cipher, d_model 64, 3000 steps): confident
    held_out(64)                            # sentences it never saw in training (parity and gate inputs)
    random_marian(out_dir, **shape)         # opus-mt-en-de's shape (or any), random weights, no tokenizer training

The directory looks like a downloaded Helsinki-NLP model (config.json, model.safetensors, source.spm, target.spm,
vocab.json[, target_vocab.json], tokenizer_config.json, generation_config.json), so the importer's real loading
code runs on it with no network. Needs transformers and sentencepiece (the `import` extra).
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "da", "qu", "zen", "ar", "el", "is", "on", "um",
             "bra", "tri", "ex"]
LANGUAGE_TOKENS = (">>de<<", ">>fr<<")


def corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """Sentences of made-up words (1-3 syllables), 3-12 words, ending in punctuation."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + rng.choice([".", "!", "?", ","])
            for _ in range(n)]


HELD_OUT_AFTER = 50_000             # held-out sentences come after this many: never among the training sentences


def held_out(n: int = 64, seed: int = 0) -> list[str]:
    """Sentences of the training corpus's words that no training run (sentences < HELD_OUT_AFTER) sees."""
    return corpus(HELD_OUT_AFTER + n, seed)[HELD_OUT_AFTER:]


def translate(text: str) -> str:
    """The task the model is trained on: the words in reverse order."""
    return " ".join(reversed(text.split()))


_CIPHER = dict(zip(SYLLABLES, random.Random(7).sample(SYLLABLES, len(SYLLABLES))))
_LONGEST_FIRST = sorted(SYLLABLES, key=len, reverse=True)


def cipher(text: str) -> str:
    """A harder-to-fake task, closer to translation: each syllable of each word replaced by its partner in a fixed
    permutation (words keep their order and punctuation), e.g. "da umon ne?" -> "ka lomi tri?"."""
    def word(w: str) -> str:
        out, i = [], 0
        while i < len(w):
            s = next((s for s in _LONGEST_FIRST if w.startswith(s, i)), w[i])
            out.append(_CIPHER.get(s, s))
            i += len(s)
        return "".join(out)
    return " ".join(word(w) for w in text.split())


TASKS = {"reverse": translate, "cipher": cipher}


def train_spm(lines: list[str], vocab_size: int, seed_text: str = "") -> bytes:
    """A unigram SentencePiece model trained on lines, as bytes (Marian's .spm files are such models)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([seed_text, *lines] if seed_text else lines),
                                   model_writer=buf, vocab_size=vocab_size, model_type="unigram",
                                   character_coverage=1.0, bos_id=-1, eos_id=1, unk_id=0, pad_id=-1, minloglevel=2,
                                   num_threads=1)
    return buf.getvalue()


def marian_vocab(spm_files: list[Path], languages: tuple[str, ...] = ()) -> dict[str, int]:
    """A Marian vocabulary: </s> 0, <unk> 1, language tokens, the pieces of the .spm files, <pad> last."""
    import sentencepiece as spm

    vocab = {"</s>": 0, "<unk>": 1}
    for token in languages:
        vocab[token] = len(vocab)
    for path in spm_files:
        sp = spm.SentencePieceProcessor(model_file=str(path))
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    return vocab


def marian_config(vocab_size: int, target_vocab_size: int | None = None, **shape):
    """A MarianConfig with the special ids of a Marian vocabulary (pad is its last id) and the given sizes."""
    from transformers import MarianConfig

    separate = target_vocab_size is not None
    pad = (target_vocab_size or vocab_size) - 1
    sizes = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128, activation_function="swish",
                 scale_embedding=True)
    sizes.update(shape)
    return MarianConfig(vocab_size=vocab_size, decoder_vocab_size=target_vocab_size or vocab_size, pad_token_id=pad,
                        eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=None, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0, share_encoder_decoder_embeddings=not separate,
                        tie_word_embeddings=not separate, **sizes)


# a realistic small model: trained long enough to be right most of the time, so its logits are confident as a real
# translation model's are (the int8 gate's token row holds on held-out texts): 3000 steps, a few minutes on one core
TRAINED = dict(task="cipher", steps=3000, d_model=64, encoder_ffn_dim=256, decoder_ffn_dim=256, lr=3e-3, warmup=300)


def build_tiny_marian(out_dir: str | Path, steps: int = 150, seed: int = 0, separate_vocabs: bool = False,
                      task: str = "reverse", sentences: int = 3000, pieces: int = 120, lr: float = 5e-3,
                      batch: int = 32, warmup: int = 0, **shape) -> Path:
    """Train SentencePiece models and a small MarianMTModel offline; save them as save_pretrained does.

    task: "reverse" (word order) or "cipher" (syllables swapped); sentences: training sentences of corpus();
    pieces: SentencePiece vocabulary per side; lr, batch, warmup: Adam with linear warmup and decay (warmup 0:
    constant lr). The defaults make the quick test model; TRAINED a realistic one. <pad> (the decoder's start)
    keeps a zero embedding throughout, and the logits bias is random (small) and fixed before training."""
    import torch
    from transformers import GenerationConfig, MarianMTModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = corpus(sentences, seed=seed)
    targets = [TASKS[task](s) for s in lines]
    config, tok = _write_tokenizer(out, lines, targets, pieces, separate_vocabs, shape)
    torch.manual_seed(seed)
    model = MarianMTModel(config)
    pad = config.pad_token_id
    with torch.no_grad():                                  # a logits bias that matters, as trained models have
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=torch.Generator()
                                                  .manual_seed(seed)) * 0.1)
    _pin(model, pad, tok.pad_token_id)
    if steps:
        train_pairs(model, tok, lines, targets, steps=steps, seed=seed, lr=lr, batch=batch, warmup=warmup,
                    after_step=lambda: _pin(model, pad, tok.pad_token_id))
    model.eval()
    model.generation_config = GenerationConfig(bad_words_ids=[[pad]], decoder_start_token_id=pad, eos_token_id=0,
                                               pad_token_id=pad, max_length=64, num_beams=4)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _write_tokenizer(out: Path, lines: list[str], targets: list[str], pieces: int, separate_vocabs: bool,
                     shape: dict):
    """Train and write the .spm models and vocabularies of `lines` -> `targets`; the MarianConfig and tokenizer."""
    from transformers import MarianTokenizer

    (out / "source.spm").write_bytes(train_spm(lines, pieces))
    (out / "target.spm").write_bytes(train_spm(targets, pieces - 20 if separate_vocabs else pieces))
    if separate_vocabs:
        source_vocab = marian_vocab([out / "source.spm"])
        target_vocab = marian_vocab([out / "target.spm"], LANGUAGE_TOKENS)
        (out / "vocab.json").write_text(json.dumps(source_vocab))
        (out / "target_vocab.json").write_text(json.dumps(target_vocab))
        config = marian_config(len(source_vocab), len(target_vocab), **shape)
        tok = MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json"),
                              target_vocab_file=str(out / "target_vocab.json"), separate_vocabs=True,
                              source_lang="en", target_lang="de")
    else:
        vocab = marian_vocab([out / "source.spm", out / "target.spm"], LANGUAGE_TOKENS)
        (out / "vocab.json").write_text(json.dumps(vocab))
        config = marian_config(len(vocab), **shape)
        tok = MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json"),
                              source_lang="en", target_lang="de")
    return config, tok


def _pin(model, pad: int, source_pad: int) -> None:
    """As in the converted opus-mt models: <pad>, the decoder's start, has a zero embedding (Marian itself starts
    from a zero vector); kept zero through training, which would otherwise move it (tied output projection)."""
    import torch

    with torch.no_grad():
        model.get_decoder().embed_tokens.weight[pad] = 0.0
        model.get_encoder().embed_tokens.weight[source_pad] = 0.0


def train_pairs(model, tok, lines: list[str], targets: list[str], steps: int, seed: int, lr: float, batch: int,
                warmup: int, after_step=None) -> None:
    """Adam on random batches of `lines` -> `targets` (tokenized once by the transformers tokenizer `tok`, its
    target framing included), on one thread; `after_step()` runs after every update (Marian pins <pad>)."""
    import torch

    pad = model.config.pad_token_id
    enc = tok(lines, text_target=targets, return_tensors="pt", padding=True)   # tokenized once
    labels = enc["labels"].masked_fill((enc["labels"] == pad) | (enc["labels"] == tok.pad_token_id), -100)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    # linear warmup, then linear decay to a tenth: the usual Transformer recipe, short
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / max(warmup, 1), max(
        0.1, 1 - (s - warmup) / max(steps - warmup, 1)))) if warmup else None
    model.train()
    try:
        with torch.enable_grad():
            for _ in range(steps):
                rows = torch.randint(0, len(lines), (batch,), generator=gen)
                mask = enc["attention_mask"][rows]
                width = int(mask.sum(1).max())
                lab = labels[rows]
                lab = lab[:, : int((lab != -100).sum(1).max())].contiguous()
                loss = model(input_ids=enc["input_ids"][rows, :width], attention_mask=mask[:, :width],
                             labels=lab).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                if after_step is not None:
                    after_step()
                if sched is not None:
                    sched.step()
    finally:
        torch.set_num_threads(threads)


def random_marian(out_dir: str | Path, vocab_size: int = 58101, seed: int = 0, **shape) -> Path:
    """A Marian directory of a given shape (opus-mt-en-de's by default) with random weights: MarianMTModel's own
    initialization, and a tokenizer (SentencePiece models trained on the generated corpus, a vocab.json padded
    with made-up pieces to vocab_size) so that it imports like a downloaded model. For benchmarks."""
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = corpus(seed=seed)
    (out / "source.spm").write_bytes(train_spm(lines, 120))
    (out / "target.spm").write_bytes(train_spm(lines, 120))
    vocab = marian_vocab([out / "source.spm"], LANGUAGE_TOKENS)
    del vocab["<pad>"]
    while len(vocab) < vocab_size - 1:
        vocab[f"\u2581w{len(vocab)}"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (out / "vocab.json").write_text(json.dumps(vocab))
    shape = {**dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                    decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                    max_position_embeddings=512), **shape}
    torch.manual_seed(seed)
    model = MarianMTModel(marian_config(len(vocab), **shape)).eval()
    model.save_pretrained(out)
    MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json")).save_pretrained(out)
    return out
