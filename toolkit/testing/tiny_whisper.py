"""A tiny random WhisperForConditionalGeneration and its tokenizer, made offline, for tests.

    model, features = random_whisper(out_dir)   # saved with save_pretrained: config, generation config,
                                                # weights, tokenizer.json; features [16+, 80, 3000] that vary its output
    model, features = zero_pair_whisper(out_dir)   # with timestamps; emits <|0.00|> <|0.00|> after <|notimestamps|>

The layout is Whisper's: text tokens first (a byte-level BPE over tiny_families' words), then <|endoftext|> (end and
pad), <|startoftranscript|> (the decoder start), the language tokens, <|translate|>, <|transcribe|>, <|startoflm|>,
<|startofprev|>, <|nospeech|>, <|notimestamps|>. generation_config.json has what WhisperForConditionalGeneration.
generate reads: lang_to_id, task_to_id, no_timestamps_token_id, suppress_tokens, begin_suppress_tokens.

A random Whisper at transformers' init (std 0.02) gives the same tokens for every input: its convolutions pass so
little of the features that the positions drown them, and its cross-attention averages 1500 frames evenly. So the
convolutions, the cross-attention's query, key and output projections are scaled up and the embeddings down
(SCALES), and each input is noise over a mel profile of its own (constant in time, which no average washes out):
greedy outputs then differ by input (14 distinct of 16 measured; tests assert it). The suppressed ids are chosen
so that suppression changes outputs: begin_suppress_tokens gets the first token most inputs choose unsuppressed,
suppress_tokens the most common later one. Needs transformers and tokenizers.
"""

from __future__ import annotations

import json
from pathlib import Path

LANGUAGES = ("en", "de", "fr")
SPECIALS = ("<|endoftext|>", "<|startoftranscript|>", *(f"<|{c}|>" for c in LANGUAGES), "<|translate|>",
            "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>")
TEXT_VOCAB = 320           # byte-level BPE: 256 bytes and merges
SIZES = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80, max_source_positions=1500,
             max_target_positions=64, dropout=0.0)
TIMESTAMPS = tuple(f"<|{i * 0.02:.2f}|>" for i in range(1501))   # 0.00 s to 30.00 s, 20 ms apart
MAX_INITIAL_TIMESTAMP = 50                                            # generation_config's: the first at most 1.00 s
SCALES = {"conv": 10.0, "cross_qk": 2.0, "cross_out": 4.0, "embed": 0.25}   # see the module docstring


def byte_bpe(directory: Path, timestamps: bool = False) -> dict[str, int]:
    """tokenizer.json (GPT-2-style byte-level BPE + Whisper's special tokens after the text tokens, and with
    `timestamps` Whisper's 1501 timestamp tokens <|0.00|> ... <|30.00|> after <|notimestamps|>, added as non-special
    tokens as openai/whisper-*'s are) and a tokenizer_config.json naming WhisperTokenizer; returns token -> id of the
    specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from toolkit.testing.tiny_families import WORDS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TEXT_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    tok.add_special_tokens(list(SPECIALS))
    if timestamps:
        tok.add_tokens(list(TIMESTAMPS))
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "WhisperTokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
              "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 64,
              "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {t: tok.token_to_id(t) for t in SPECIALS} | {"vocab_size": tok.get_vocab_size(), "space": tok.token_to_id("Ġ")}


def generation_config(ids: dict, timestamps: bool = False) -> dict:
    """What WhisperForConditionalGeneration.generate reads: the prompt tokens by name, the suppressed ids (and with
    `timestamps` max_initial_timestamp_index)."""
    eot = ids["<|endoftext|>"]
    extra = {"max_initial_timestamp_index": MAX_INITIAL_TIMESTAMP} if timestamps else {}
    return extra | {"decoder_start_token_id": ids["<|startoftranscript|>"], "eos_token_id": eot, "pad_token_id": eot,
            "bos_token_id": eot, "is_multilingual": True, "no_timestamps_token_id": ids["<|notimestamps|>"],
            "lang_to_id": {f"<|{c}|>": ids[f"<|{c}|>"] for c in LANGUAGES},
            "task_to_id": {t: ids[f"<|{t}|>"] for t in ("translate", "transcribe")},
            "suppress_tokens": [1, 2, 7, 11, ids["<|startoflm|>"], ids["<|startofprev|>"], ids["<|nospeech|>"]],
            "begin_suppress_tokens": [ids["space"], eot], "max_length": SIZES["max_target_positions"]}


def random_whisper(directory: str | Path, seed: int = 0, inputs: int = 16, timestamps: bool = False):
    """(WhisperForConditionalGeneration in eval mode, features [inputs, 80, 3000] float32) saved to directory;
    `timestamps`: with Whisper's timestamp tokens (byte_bpe); their embedding rows are drawn as the others are, and
    text and timestamps both get chosen (tests/test_transcribe.py asserts it)."""
    import torch
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ids = byte_bpe(directory, timestamps)
    gen = generation_config(ids, timestamps)
    config = whisper_config(ids, gen)
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        encoder, decoder = model.model.encoder, model.model.decoder
        decoder.embed_tokens.weight.mul_(SCALES["embed"])
        encoder.conv1.weight.mul_(SCALES["conv"])
        encoder.conv2.weight.mul_(SCALES["conv"])
        for layer in decoder.layers:
            layer.encoder_attn.q_proj.weight.mul_(SCALES["cross_qk"])
            layer.encoder_attn.k_proj.weight.mul_(SCALES["cross_qk"])
            layer.encoder_attn.out_proj.weight.mul_(SCALES["cross_out"])
    features = sample_features(inputs, seed + 1)
    gen = suppress_chosen(model, gen, features)
    model.config.suppress_tokens, model.config.begin_suppress_tokens = gen["suppress_tokens"], \
        gen["begin_suppress_tokens"]
    model.generation_config = transformers.GenerationConfig(**gen)
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return model, features


def zero_pair_whisper(directory: str | Path, seed: int = 0, inputs: int = 8, scale: float = 10.0):
    """random_whisper with timestamps whose ids after <|startoftranscript|> <|lang|> <|task|> <|notimestamps|> are
    <|0.00|> <|0.00|> for every input, then text that varies by input and no other timestamp: the decoder's position
    embeddings at the prompt's last position and the next gain `scale` times the unit direction of <|0.00|>'s
    (centred) embedding row, which the residual stream carries past both layers to the tied head, and
    suppress_tokens (generation config and config) gains every timestamp after <|0.00|>. (model, features), saved to
    directory."""
    import torch

    directory = Path(directory)
    model, features = random_whisper(directory, seed, inputs, timestamps=True)
    gen = json.loads((directory / "generation_config.json").read_text())
    zero = gen["no_timestamps_token_id"] + 1                              # <|0.00|>
    gen["suppress_tokens"] = sorted({*gen["suppress_tokens"], *range(zero + 1, zero + len(TIMESTAMPS))})
    last = 3                                             # <|startoftranscript|> <|lang|> <|task|> <|notimestamps|>
    with torch.no_grad():
        row = model.model.decoder.embed_tokens.weight[zero]
        direction = row - row.mean()
        model.model.decoder.embed_positions.weight[last:last + 2] += scale * direction / direction.norm()
    model.config.suppress_tokens = model.generation_config.suppress_tokens = gen["suppress_tokens"]
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return model, features


def whisper_config(ids: dict, gen: dict):
    """The WhisperConfig of SIZES over byte_bpe's ids, its special and suppressed ids generation_config's."""
    import transformers

    return transformers.WhisperConfig(vocab_size=ids["vocab_size"], **SIZES, pad_token_id=gen["pad_token_id"],
                                      bos_token_id=gen["bos_token_id"], eos_token_id=gen["eos_token_id"],
                                      decoder_start_token_id=gen["decoder_start_token_id"],
                                      suppress_tokens=gen["suppress_tokens"],
                                      begin_suppress_tokens=gen["begin_suppress_tokens"])


def suppress_chosen(model, gen: dict, features) -> dict:
    """gen with the tokens unsuppressed greedy decoding picks most (first, and later) added to begin_suppress_tokens
    and suppress_tokens, so that both processors change what is generated."""
    from collections import Counter

    import torch
    import transformers

    model.generation_config = transformers.GenerationConfig(**{**gen, "suppress_tokens": None,
                                                                "begin_suppress_tokens": None})
    with torch.no_grad():
        raw = model.generate(features, language="en", task="transcribe", max_new_tokens=8).tolist()
    first = Counter(row[0] for row in raw).most_common(1)[0][0]
    later = Counter(t for row in raw for t in row[1:] if t != first).most_common(1)[0][0]
    return {**gen, "suppress_tokens": sorted({*gen["suppress_tokens"], later}),
            "begin_suppress_tokens": [*gen["begin_suppress_tokens"], first]}


def sample_features(inputs: int, seed: int):
    """[inputs, 80, 3000] float32: noise (std 0.5) over a mel profile per input (std 1, the same at every frame)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    profile = torch.randn(inputs, SIZES["num_mel_bins"], 1, generator=gen)
    noise = torch.randn(inputs, SIZES["num_mel_bins"], 2 * SIZES["max_source_positions"], generator=gen)
    return noise * 0.5 + profile


__all__ = ["random_whisper", "zero_pair_whisper", "byte_bpe", "generation_config", "whisper_config",
           "sample_features", "LANGUAGES", "SPECIALS", "SIZES", "TIMESTAMPS", "MAX_INITIAL_TIMESTAMP"]
