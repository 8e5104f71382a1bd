"""A tiny WhisperForConditionalGeneration briefly trained on speech synthesized here, for tests.

    model, held_out = trained_whisper(cache_dir)   # cached: trained once, then loaded from cache_dir/model
    held_out: [(features [80, 3000] float32, language, text, samples)], clips the model was not trained on

The clips are espeak-ng's (Debian's `espeak-ng`; `espeak-ng -w`, 22.05 kHz, resampled to 16 kHz): phrases of one
to three of tiny_families' words (the BPE's words, so each is a token or two), spoken by an English and a German
voice at two speeds; the language token is the voice's, so language detection varies. The targets carry Whisper's
timestamps: <|lang|> <|transcribe|> <|0.00|> text <|end|> <|endoftext|>, <|end|> the clip's length rounded to 20 ms,
so the model emits timestamp tokens as a real Whisper does. The model and tokenizer are tiny_whisper's
(SIZES, byte_bpe with timestamps, generation_config). Needs transformers, tokenizers, soundfile, soxr, espeak-ng.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import time
from pathlib import Path

VOICES = (("en", "en", 150), ("en", "en", 190), ("de", "de", 150), ("de", "de", 190))   # (language, voice, wpm)
TRAIN_CLIPS = 320
HELD_OUT_CLIPS = 24
STEPS = 1000
BATCH = 16
TRAIN_POSITIONS = 300    # the encoder states trained on: the first 6 s (every clip is shorter)


def phrases(count: int, seed: int) -> list[tuple[str, str, int, str]]:
    """count (language, voice, speed, text): a voice round-robin, one to three words drawn by `seed`."""
    from toolkit.testing.tiny_families import WORDS

    rng = random.Random(seed)
    return [(*VOICES[i % len(VOICES)], " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))))
            for i in range(count)]


def speak(directory: Path, items) -> list:
    """[(16 kHz float32 samples, language, text)] of each item, spoken by espeak-ng into directory."""
    import numpy as np
    import soundfile as sf

    from runtime.audio import resample

    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is missing: install it with `apt-get install -y espeak-ng`")
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (lang, voice, speed, text) in enumerate(items):
        path = directory / f"{i:04d}.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(path), text], check=True)
        audio, rate = sf.read(path, dtype="float32")
        out.append((resample(np.asarray(audio), rate), lang, text))
    return out


def target(tokenizer, ids: dict, lang: str, text: str, seconds: float) -> list[int]:
    """The labels: <|lang|> <|transcribe|> <|0.00|> text <|end|> <|endoftext|> (generate's prompt then its ids)."""
    end = min(round(seconds / 0.02) * 0.02, 30.0)
    stamps = tokenizer.convert_tokens_to_ids(["<|0.00|>", f"<|{end:.2f}|>"])
    return [ids[f"<|{lang}|>"], ids["<|transcribe|>"], stamps[0], *tokenizer.encode(" " + text,
            add_special_tokens=False), stamps[1], ids["<|endoftext|>"]]


def build(directory: Path, seed: int = 0):
    """A fresh tiny Whisper with timestamps (tiny_whisper's config, generation config and tokenizer) saved to
    directory; returns (model, ids, tokenizer)."""
    import torch
    import transformers

    from toolkit.testing.tiny_whisper import byte_bpe, generation_config, whisper_config

    directory.mkdir(parents=True, exist_ok=True)
    ids = byte_bpe(directory, timestamps=True)
    gen = generation_config(ids, timestamps=True)
    gen["suppress_tokens"] = [ids[t] for t in ("<|startoflm|>", "<|startofprev|>", "<|nospeech|>")]
    gen["begin_suppress_tokens"] = [ids["space"], ids["<|endoftext|>"]]
    config = whisper_config(ids, gen)
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(config)
    model.generation_config = transformers.GenerationConfig(**gen)
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return model, ids, transformers.AutoTokenizer.from_pretrained(directory)


def encode(model, features, chunk: int = 16):
    """The encoder's last hidden states [n, 1500, d_model] of features [n, 80, 3000], without gradients."""
    import torch

    with torch.no_grad():
        return torch.cat([model.model.encoder(features[i:i + chunk]).last_hidden_state
                          for i in range(0, len(features), chunk)])


def train(model, features, labels, steps: int = STEPS, batch: int = BATCH, lr: float = 3e-3, seed: int = 0) -> dict:
    """AdamW on the decoder alone (features [n, 80, 3000], labels [n, L] padded with -100), linear warm-up then
    decay; the encoder stays at its init (convolutions scaled up so the features pass, as tiny_whisper's), its
    states computed once and cut to the first TRAIN_POSITIONS (the clips' 6 s; the rest is silence): a backward pass
    through 1500 frames of self-attention takes seconds a batch on two shared cores, the cross-attention over 1500
    states a second. Returns the first and last losses and the seconds taken."""
    import torch

    from toolkit.testing.tiny_whisper import SCALES

    started = time.perf_counter()
    with torch.no_grad():
        model.model.encoder.conv1.weight.mul_(SCALES["conv"])
        model.model.encoder.conv2.weight.mul_(SCALES["conv"])
    states = encode(model.eval(), features)[:, :TRAIN_POSITIONS]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.model.decoder.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    model.model.decoder.train()
    losses = []
    for _ in range(steps):
        pick = torch.randint(len(states), (batch,), generator=gen)
        loss = model(encoder_outputs=(states[pick],), labels=labels[pick]).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return {"first_loss": losses[0], "last_loss": sum(losses[-50:]) / len(losses[-50:]),
            "seconds": round(time.perf_counter() - started, 1)}


def trained_whisper(cache: str | Path, steps: int = STEPS):
    """(trained model in eval mode, held-out clips); trains once into cache/model (with train.json: clip counts,
    losses, seconds), later calls load it. The held-out clips are spoken again each call (seconds)."""
    import torch
    import transformers

    from runtime.audio import batch_features

    cache = Path(cache)
    held = speak(cache / "held-out", phrases(HELD_OUT_CLIPS, seed=1))
    held_out = [(f, lang, text, s) for f, (s, lang, text) in zip(batch_features([h[0] for h in held]), held)]
    if (cache / "model" / "train.json").exists():
        model = transformers.WhisperForConditionalGeneration.from_pretrained(cache / "model").eval()
        return model, held_out
    work = cache / "building"
    shutil.rmtree(work, ignore_errors=True)
    model, ids, tokenizer = build(work)
    clips = speak(cache / "train", phrases(TRAIN_CLIPS, seed=0))
    features = torch.from_numpy(batch_features([c[0] for c in clips]))
    rows = [target(tokenizer, ids, lang, text, len(s) / 16000) for s, lang, text in clips]
    labels = torch.full((len(rows), max(map(len, rows))), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        labels[i, :len(row)] = torch.tensor(row)
    record = train(model, features, labels, steps) | {"train_clips": len(clips), "held_out_clips": len(held_out)}
    model.save_pretrained(work)
    (work / "train.json").write_text(json.dumps(record, indent=2))
    shutil.rmtree(cache / "model", ignore_errors=True)
    work.rename(cache / "model")
    return model, held_out


__all__ = ["trained_whisper", "phrases", "speak", "target", "build", "train", "VOICES", "TRAIN_CLIPS",
           "HELD_OUT_CLIPS"]
