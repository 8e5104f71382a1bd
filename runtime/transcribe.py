"""Whisper speech to text: a `Transcriber` over a bundle (or any loaded engine) gives a `Transcription`.

    from runtime import Transcriber

    whisper = Transcriber("out/whisper-int8")                 # a Whisper bundle (or Transcriber.from_engine)
    result = whisper.transcribe("talk.wav", language="auto", timestamps=True)
    result.language, result.text
    for s in result.segments:                                 # start and end in seconds
        print(f"[{s.start:.2f} -> {s.end:.2f}] {s.text}")

One 30-second window is decoded as transformers' `WhisperForConditionalGeneration.generate` decodes it: the
prompt after <|startoftranscript|> (runtime.speech.prompt_ids; without <|notimestamps|> when timestamps are asked
for, the timestamp rules then on: runtime.processors.timestamp_rules), the model's suppressed ids, greedy or beam.
The language, when not given (or "auto"), is detected as its `detect_language` does: one decoder step from
<|startoftranscript|>, the most likely of the language tokens. A text prompt (initial_prompt=; generate's
prompt_ids) comes first: the decoder starts from <|startofprev|>, then the prompt's ids, <|startoftranscript|> and
the rest, all forced, none returned. Audio past 30 s goes window by window (runtime.longform), as do the temperature
fallback, the no-speech skip and conditioning on the previous windows' text.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from runtime.audio import CHUNK_SECONDS, HOP_LENGTH, SAMPLING_RATE, _samples
from runtime.errors import InputError
from runtime.generate import encoder_inputs, generate
from runtime.request import Request
from runtime.search import SearchOptions, log_softmax
from runtime.speech import prompt_ids

SECONDS_PER_TIMESTAMP = 0.02          # <|0.00|>, <|0.02|>, ...: one timestamp token per two mel frames
FRAMES = CHUNK_SECONDS * SAMPLING_RATE // HOP_LENGTH   # 3000 log-mel frames a window
NO_SPEECH_TOKENS = ("<|nospeech|>", "<|nocaptions|>")  # its name since large-v3, and before


@dataclass
class Segment:
    """A stretch of the audio and its text (one per window without timestamps; one per timestamp pair with)."""

    id: int
    start: float                      # seconds from the start of the audio
    end: float
    text: str
    tokens: list[int]                 # the segment's ids, its timestamps included
    avg_logprob: float                # its window's tokens' summed log-probability / (their count + 1)
    compression_ratio: float          # its window's text: bytes / zlib-compressed bytes (repetition is high)
    no_speech_prob: float             # its window's <|nospeech|> probability after <|startoftranscript|>
    temperature: float                # the temperature its window was decoded at (0: greedy or beam)
    seek: int = 0                     # its window's first log-mel frame (10 ms each), openai-whisper's `seek`


@dataclass
class Transcription:
    """The text of an audio clip, its language, and its segments."""

    text: str
    language: str | None              # its code; None for an English-only model
    language_probability: float | None   # detected: its probability among the language tokens (given: None)
    segments: list[Segment] = field(default_factory=list)
    duration: float = 0.0             # seconds of audio

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Window:
    """One decoded window: its ids after the prompt (end token stripped) and what the fallback reads."""

    tokens: list[int]
    avg_logprob: float
    compression_ratio: float
    temperature: float


def compression_ratio(text: str) -> float:
    """bytes / zlib-compressed bytes of a text (openai-whisper's): a repetitive decode scores high."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


class Transcriber:
    """A Whisper model that transcribes (or translates into English) audio; see the module docstring."""

    def __init__(self, path: str | Path, provider: str = "auto", threads: int | None = None, **bundle_options):
        """Load the Whisper bundle directory `path` (runtime.bundle.load_bundle's options); BundleError when it is
        not a bundle, InputError when it is not a Whisper model's."""
        from runtime.bundle import load_bundle

        bundle = load_bundle(path, provider=provider, threads=threads, **bundle_options)
        self._setup(bundle.engine, bundle.tokenizer, str(path))

    @classmethod
    def from_engine(cls, engine, tokenizer, name: str = "") -> "Transcriber":
        """A transcriber over a loaded engine (e.g. toolkit's TorchEngine of a checkpoint) and its tokenizer."""
        self = cls.__new__(cls)
        self._setup(engine, tokenizer, name or type(engine).__name__)
        return self

    def _setup(self, engine, tokenizer, name: str) -> None:
        spec = getattr(tokenizer, "spec", None) or {}
        if getattr(engine, "feature_shape", None) is None or "decoder_prompt" not in spec:
            raise InputError(f"{name} is not a Whisper model (its encoder reads no audio features); give a bundle "
                             f"or checkpoint imported from WhisperForConditionalGeneration")
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.no_timestamps = tokenizer._ids(["<|notimestamps|>"], "notimestamps")[0]
        self.timestamp_begin = self.no_timestamps + 1      # transformers' rule: no_timestamps_token_id + 1
        self.has_timestamps = engine.vocab_size > self.timestamp_begin
        self.language_ids = tokenizer._ids([tokenizer.language_token(c) for c in tokenizer.languages], "languages") \
            if tokenizer.languages else []
        known = [t for t in NO_SPEECH_TOKENS if tokenizer._tok.token_to_id(t) is not None]
        self.no_speech = tokenizer._ids(known[:1], "nospeech")[0] if known else None
        self.start_of_prev = tokenizer._tok.token_to_id("<|startofprev|>")   # before a text prompt (None: no prompts)
        self.context_limit = engine.max_len // 2 - 1   # most prompt ids a window takes: openai's n_text_ctx // 2 - 1

    def encode(self, features: np.ndarray):
        """The encoder's outputs for features [B, mels, frames], for first_step and decode_window to share (one
        encoder run a window); None for an engine that cannot run its encoder alone (each decode then runs it)."""
        if not hasattr(self.engine, "encode"):
            return None
        return self.engine.encode(*encoder_inputs(self.engine, list(features)))

    def first_step(self, features: np.ndarray, encoded=None, context=()) -> np.ndarray:
        """Log-probabilities [B, V] of the decoder's step from <|startoftranscript|> over features [B, mels,
        frames]: what detect_language reads (no context) and the no-speech probability (after the window's
        `context`, its text prompt: <|startofprev|> and those ids first, fed at once, as openai-whisper reads it at
        the sot index). encoded: self.encode(features)."""
        ids, mask = encoder_inputs(self.engine, list(features))
        extra = {} if encoded is None else {"encoded": encoded}
        fed = [*self.lead(context), self.engine.bos_id]
        state = self.engine.start(ids, mask, 1, len(fed), **extra)
        tokens = np.tile(np.asarray(fed, dtype=np.int64), (len(features), 1))
        logits = state.step(tokens[:, 0], None) if len(fed) == 1 else state.feed(tokens)[:, -1]
        return log_softmax(np.asarray(logits, dtype=np.float32))

    def lead(self, context) -> list[int]:
        """The ids before <|startoftranscript|> of a window with this context (text prompt ids): <|startofprev|>
        and the context's ids; none without one."""
        return [self.start_of_prev, *context] if len(context) else []

    def prompt_ids(self, prompt) -> list[int]:
        """A text prompt's ids (openai-whisper's initial_prompt: the tokens of " " + its stripped text), or ids
        given as a list (a leading <|startofprev|> dropped, as transformers' prompt_ids carry it); InputError for
        a model without <|startofprev|>, a prompt that is neither, or one holding special tokens."""
        if self.start_of_prev is None:
            raise InputError(f"{self.name} has no <|startofprev|> token: it takes no prompt; drop the prompt")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode_target(" " + prompt.strip()) if prompt.strip() else []
        elif isinstance(prompt, (list, tuple)) and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                                       for i in prompt):
            ids = [int(i) for i in prompt]
            ids = ids[1:] if ids[:1] == [self.start_of_prev] else ids
        else:
            raise InputError(f"a prompt is a text or a list of token ids, got {prompt!r}")
        stamps_ok = not isinstance(prompt, str)                     # ids may carry timestamps (a window's own)
        special = [i for i in ids if not (0 <= i < self.engine.eos_id or stamps_ok and self.timestamp_begin <= i <
                                          self.engine.vocab_size)]
        if special:
            raise InputError(f"the prompt holds special token id(s) {special[:5]}, not text; take them out of the "
                             f"prompt")
        return ids

    def detect_language(self, features: np.ndarray, first: np.ndarray | None = None) -> list[tuple[str, float]]:
        """Each window's (language code, its probability among the language tokens): the argmax over the language
        tokens of the first step, as WhisperForConditionalGeneration.detect_language."""
        if not self.language_ids:
            raise InputError(f"{self.name} is an English-only Whisper model: it detects no language; drop language")
        first = self.first_step(features) if first is None else first
        scores = first[:, self.language_ids].astype(np.float64)
        probs = np.exp(scores - scores.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        best = scores.argmax(axis=1)
        return [(self.tokenizer.languages[b], float(probs[i, b])) for i, b in enumerate(best)]

    def prompt(self, language: str | None, task: str, timestamps: bool) -> list[int]:
        """The forced ids after <|startoftranscript|>; with timestamps, without <|notimestamps|>."""
        if timestamps and not self.has_timestamps:
            raise InputError(f"{self.name} has no timestamp tokens (its vocabulary ends at <|notimestamps|>); "
                             f"drop timestamps")
        ids = prompt_ids(self.tokenizer, language, task)
        return [i for i in ids if i != self.no_timestamps] if timestamps else ids

    def options(self, prompt: list[int], timestamps: bool, beam: int = 1, temperature: float = 0.0,
                max_new_tokens: int | None = None, max_initial_timestamp: int | None = 50,
                seed: int = 0, context=()) -> SearchOptions:
        """The SearchOptions of one window: greedy or beam at temperature 0, else sampling at that temperature.
        `context`: the window's text prompt ids (at most context_limit): the decoder then starts from
        <|startofprev|>, its forced prefix the context, <|startoftranscript|>, `prompt` (transformers' prompt_ids).
        max_new_tokens None: half the decoder's positions, at most what the prefix leaves."""
        if len(context) > self.context_limit:
            raise ValueError(f"a window's context holds at most {self.context_limit} ids, got {len(context)}")
        prefix = [*context, self.engine.bos_id, *prompt] if len(context) else list(prompt)
        room = self.engine.max_len - len(prefix)
        if max_new_tokens is not None and max_new_tokens > room:
            raise InputError(f"max_new_tokens {max_new_tokens} and the window's {len(prefix)} prompt tokens pass the "
                             f"model's {self.engine.max_len} decoder positions; give max_new_tokens of at most "
                             f"{room}" + (" (or a shorter prompt)" if len(context) else ""))
        new = min(room, max(1, self.engine.max_len // 2)) if max_new_tokens is None else max_new_tokens
        sampled = dict(sample=True, temperature=temperature, seed=seed) if temperature > 0 else dict(beam=beam)
        stamps = dict(timestamps=self.timestamp_begin, max_initial_timestamp=max_initial_timestamp) \
            if timestamps else {}
        start = dict(start_id=self.start_of_prev) if len(context) else {}
        return SearchOptions(max_new_tokens=new, prefix_ids=(tuple(prefix),), return_logprobs=True, **sampled,
                             **stamps, **start)

    def decode_window(self, features: np.ndarray, opts: SearchOptions, encoded=None) -> Window:
        """One window's features [mels, frames] decoded with opts: its ids after the prompt, and their scores.
        encoded: self.encode(features[None]) (the encoder is then not run again)."""
        request = Request.build(self.engine, [features], None, opts)
        hyp = generate(self.engine, request, encoded=encoded)[0][0]
        start = len(opts.prefix_ids[0])
        tokens, lps = hyp.tokens[start:], (hyp.logprobs or [])[start:]
        text_ids = [t for t in tokens if t != self.engine.eos_id]
        avg = float(np.sum(lps)) / (len(text_ids) + 1)
        text = self.text_of(text_ids)
        return Window(text_ids, avg, compression_ratio(text), opts.temperature if opts.sample else 0.0)

    def text_of(self, ids) -> str:
        """The text of ids, timestamps and special tokens left out."""
        return self.tokenizer.decode([int(i) for i in ids if i < self.timestamp_begin])

    def transcribe(self, audio, language: str | None = None, task: str = "transcribe", timestamps: bool = False,
                   beam: int = 1, **options) -> Transcription:
        """The Transcription of one clip (a path, a file's bytes, or 16 kHz mono samples). language: a code, or
        None / "auto" to detect it (multilingual models); task: "transcribe" or "translate" (into English);
        timestamps: segments from the model's timestamp tokens; beam: 1 greedy. Other options (runtime.longform.
        transcribe_samples): temperatures, compression_ratio_threshold, logprob_threshold, no_speech_threshold,
        max_new_tokens, max_initial_timestamp, initial_prompt (text, or ids), condition_on_previous_text,
        carry_initial_prompt, prompt_reset_on_temperature. InputError naming a bad one."""
        from runtime.longform import transcribe_samples

        samples = _samples(audio)
        return transcribe_samples(self, samples, language, task, timestamps, beam, **options)


__all__ = ["Transcriber", "Transcription", "Segment", "Window", "compression_ratio", "SECONDS_PER_TIMESTAMP",
           "FRAMES"]
