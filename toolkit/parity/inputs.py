"""The inputs a token verdict is judged on, chosen by one rule for `onnxformer parity` and optimize's gate, so both
judge a bundle on the same inputs:

    source texts given (--input, one a line, through the model's tokenizer, the first `samples`)
    or, for an audio encoder, audio clips given (optimize --gate-audio: their log-mel features, the first `samples`)
    > the held-out inputs of the model's task (toolkit.reference.tasks: the dates model's)
    > `samples` seeded random id sequences (an audio encoder's: seeded random log-mel features, FEATURES)

`samples` defaults to DEFAULT_SAMPLES in both. Random ids are what a model that takes ids sees, but a text model
(one with a tokenizer) never sees them: its verdict on them says it is not representative.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.errors import AudioError, InputError
from toolkit.reference.tasks import task_parity_inputs

DEFAULT_SAMPLES = 100               # inputs per token check, for parity and the optimize gate alike
UNREPRESENTATIVE = ("random ids are not representative of a text model's inputs (it never sees them): pass "
                    "--input with source texts like the model's own (one a line)")

FEATURES_NOTE = ("random log-mel features are not speech: a Whisper bundle judged on them is not judged on what it "
                 "hears; judge it on speech clips like the model's own (optimize --gate-audio, parity --audio "
                 "FILES|DIR)")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".opus", ".mp3")


def not_representative(source: str) -> str:
    """Why inputs from `source` (ParityInputs.source) do not represent the model's own: random ids for a text
    model, or random features for an audio encoder."""
    return FEATURES_NOTE if "log-mel feature" in source else UNREPRESENTATIVE


def input_kind(source: str) -> str:
    """What the model reads, for the NOT-representative notes of the tables."""
    return "audio" if "log-mel feature" in source else "text"


@dataclass(frozen=True)
class ParityInputs:
    """Token id inputs, where they came from, and whether they are inputs the model is made for."""

    seqs: list[list[int]]
    source: str                     # "100 dates held-out examples" | "64 given source texts" | "100 random id ..."
    representative: bool = True     # False: random ids for a text model

    @property
    def note(self) -> str | None:
        return None if self.representative else not_representative(self.source)


def choose_inputs(config, tokenizer=None, samples: int = DEFAULT_SAMPLES, texts: list[str] | None = None,
                  seed: int = 0, audio=None, option: str = "--gate-audio") -> ParityInputs:
    """The inputs by the rule above. config: the model's ModelConfig; tokenizer: its tokenizer or None; audio: an
    audio model's clips given (files or directories; audio_inputs), `option` the flag that gave them."""
    if samples < 1:
        raise InputError(f"--samples must be at least 1, got {samples}")
    if audio:
        return audio_inputs(config, audio, samples, option)
    if texts:
        if tokenizer is None:
            raise InputError("--input texts need a model with a tokenizer; this one has none (it takes token ids), "
                             "so leave --input out and parity uses random ids")
        texts = texts[:samples]
        return ParityInputs([tokenizer.encode(t) for t in texts], f"{len(texts)} given source texts")
    if config.features:
        return random_features(config, samples, seed)
    held_out = task_parity_inputs(tokenizer, config.max_len, samples)
    if held_out is not None:
        return ParityInputs(*held_out)
    rng = np.random.default_rng(seed)
    vocab = config.source_vocab_size
    low, longest = min(3, vocab - 1), min(config.max_len, 24)
    lens = rng.integers(1, longest + 1, size=samples)
    return ParityInputs([rng.integers(low, vocab, size=int(n)).tolist() for n in lens],
                        f"{samples} random id sequences, lengths 1..{longest}", representative=tokenizer is None)


def parity_inputs(config, tokenizer=None, samples: int = DEFAULT_SAMPLES, seed: int = 0
                  ) -> tuple[list[list[int]], str]:
    """(token id inputs, their description) without given texts: the task's held-out inputs, else random ids."""
    chosen = choose_inputs(config, tokenizer, samples, seed=seed)
    return chosen.seqs, chosen.source


__all__ = ["ParityInputs", "choose_inputs", "parity_inputs", "audio_inputs", "audio_files", "DEFAULT_SAMPLES",
           "UNREPRESENTATIVE", "AUDIO_SUFFIXES"]


def audio_files(paths, option: str = "--gate-audio") -> list:
    """The files of --gate-audio FILES|DIR in order: a file as given, a directory's audio files (AUDIO_SUFFIXES, not
    its subdirectories) sorted by name. option: the flag the messages name."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            inside = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in AUDIO_SUFFIXES)
            if not inside:
                raise InputError(f"{option} {path} holds no audio files ({', '.join(AUDIO_SUFFIXES)}); give a "
                                 f"directory of speech clips, or the clips themselves")
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise InputError(f"{option} {path} does not exist; give speech clips (files, or a directory of them)")
    return found


def audio_inputs(config, paths, samples: int = DEFAULT_SAMPLES, option: str = "--gate-audio") -> ParityInputs:
    """An audio encoder's inputs from audio files (audio_files; the first `samples`): each clip's log-mel features
    [n_mels, 3000], its first 30 s padded with silence, as runtime.audio makes them for a request."""
    if samples < 1:
        raise InputError(f"--samples must be at least 1, got {samples}")
    if not config.features:
        raise InputError(f"{option} is for an audio (Whisper) bundle, and this one reads text: leave it out, or "
                         f"give source texts with --input")
    from runtime.audio import batch_features

    files = audio_files(paths, option)[:samples]
    try:
        features = batch_features(files, config.n_mels)
    except AudioError as exc:
        raise AudioError(f"{option}: {exc}") from None
    return ParityInputs(list(features), f"{len(files)} given audio clips' log-mel features")


def random_features(config, samples: int, seed: int = 0) -> ParityInputs:
    """An audio encoder's inputs [n_mels, 2 * source_positions] float32: noise (std 0.5) over a random mel profile
    per input, the same at every frame (noise alone averages out in cross-attention: outputs would not vary)."""
    rng = np.random.default_rng(seed)
    shape = (config.n_mels, 2 * config.source_positions)
    seqs = [(rng.standard_normal(shape) * 0.5 + rng.standard_normal((shape[0], 1))).astype(np.float32)
            for _ in range(samples)]
    return ParityInputs(seqs, f"{samples} random log-mel feature inputs {list(shape)}", representative=False)
