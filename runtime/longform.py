"""Audio of any length, 30-second window by window, as openai-whisper's `transcribe` goes.

    result = transcribe_samples(transcriber, samples, language=None, task="transcribe", timestamps=True, beam=1)

The log-mel of the whole clip (a clip of at most 30 s: `features_for`'s, the encoder's input as transformers makes
it) is cut into windows of 3000 frames from `seek`. Each window is decoded at temperature 0 (greedy, or beam) and,
where its text repeats (compression ratio above `compression_ratio_threshold`, 2.4) or its tokens are unlikely
(average log-probability below `logprob_threshold`, -1.0), again at each of `temperatures` (sampling) until one
passes. A window whose <|nospeech|> probability passes `no_speech_threshold` (0.6) while its tokens are unlikely
holds no speech: it is skipped. With timestamps the window's text is cut into segments at its timestamp pairs and
the next window starts at its last timestamp (the whole window when it ends with one lone timestamp); without,
the window is one segment and the next starts after it; a segment's start and end are clamped into its window's
audio (a last timestamp past the clip's end ends its segment at that end). The language is detected once, on the
first window.

A text prompt goes before <|startofprev|>... <|startoftranscript|> as openai-whisper and faster-whisper put it
(`Context`): `initial_prompt` (text, or ids) conditions the first window; with `condition_on_previous_text` each
window is conditioned on the prompt and the text of the windows before it (their segments' ids, timestamps
included), forgotten after a window decoded at a temperature above `prompt_reset_on_temperature` (0.5); with
`carry_initial_prompt` the initial prompt leads every window's. A window takes at most max_len // 2 - 1 prompt ids
(223 of Whisper's 448), the latest (cut from the left, as openai-whisper cuts `prompt[-(n_text_ctx // 2 - 1):]`):
the prompt then always leaves the window room for its text. The prompt's ids are given, never scored or returned.
Its window's no-speech probability is read after it (openai-whisper's, at the sot index); the language is
detected without it (detect_language's one step from <|startoftranscript|>).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from runtime.audio import HOP_LENGTH, N_SAMPLES, SAMPLING_RATE, log_mel_spectrogram, pad_or_trim
from runtime.errors import InputError

TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
TIMESTAMP_FRAMES = 2                 # mel frames per timestamp step (20 ms)
TASKS = ("transcribe", "translate")


def whole_mel(samples: np.ndarray, n_mels: int) -> tuple[np.ndarray, int]:
    """(log-mel [n_mels, frames], frames of audio): a clip of at most 30 s padded to 30 s (features_for's numbers);
    a longer one with 30 s of silence after it, as openai-whisper pads before cutting windows."""
    if len(samples) <= N_SAMPLES:
        return log_mel_spectrogram(pad_or_trim(samples), n_mels), min(len(samples) // HOP_LENGTH, 3000) or 1
    padded = np.concatenate([samples, np.zeros(N_SAMPLES, dtype=np.float32)])
    return log_mel_spectrogram(padded, n_mels), len(samples) // HOP_LENGTH


class Context:
    """The prompt ids of each window (after <|startofprev|>): openai-whisper's `all_tokens[prompt_reset_since:]`,
    the initial prompt first; see the module docstring."""

    def __init__(self, initial: list[int], condition: bool, carry: bool, reset_temperature: float, limit: int):
        self.initial, self.condition, self.carry = list(initial)[-limit:] if limit > 0 else [], condition, carry
        self.reset_temperature, self.limit = reset_temperature, limit
        self.tokens, self.since = list(self.initial), 0

    def ids(self) -> list[int]:
        """This window's prompt ids (empty: it has none), at most `limit`, the latest."""
        if self.carry and self.initial:                             # openai-whisper's carry_initial_prompt
            room = self.limit - len(self.initial)
            rest = self.tokens[max(len(self.initial), self.since):]
            return self.initial + (rest[-room:] if room > 0 and rest else [])
        return self.tokens[self.since:][-self.limit:] if self.limit > 0 else []

    def add(self, ids: list[int], temperature: float) -> None:
        """A decoded window's kept ids; without condition_on_previous_text, or after a hot fallback, the next
        window starts afresh."""
        self.tokens += ids
        if not self.condition or temperature > self.reset_temperature:
            self.since = len(self.tokens)


def segments_of(tr, tokens: list[int], offset: float, window_frames: int) -> tuple[list[tuple], int]:
    """openai-whisper's cut of one window's ids (end token stripped): [(start s, end s, ids)], each time clamped
    into the window's audio (offset to offset + window_frames), and how many frames the next window starts after
    this one's start."""
    pieces, advance = _cut(tr, tokens, offset, window_frames)
    end = offset + window_frames * HOP_LENGTH / SAMPLING_RATE
    return [(min(max(a, offset), end), min(max(b, offset), end), ids) for a, b, ids in pieces], advance


def _cut(tr, tokens: list[int], offset: float, window_frames: int) -> tuple[list[tuple], int]:
    begin, step = tr.timestamp_begin, TIMESTAMP_FRAMES * HOP_LENGTH / SAMPLING_RATE
    stamp = [t >= begin for t in tokens]
    lone_end = stamp[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]
    if not cuts:                                                   # no pair: one segment (up to a last timestamp)
        duration = window_frames * HOP_LENGTH / SAMPLING_RATE
        stamps = [t for t in tokens if t >= begin]
        if stamps and stamps[-1] != begin:
            duration = (stamps[-1] - begin) * step
        return [(offset, offset + duration, tokens)], window_frames
    if lone_end:
        cuts.append(len(tokens))
    out, last = [], 0
    for cut in cuts:
        piece = tokens[last:cut]
        out.append((offset + (piece[0] - begin) * step, offset + (piece[-1] - begin) * step, piece))
        last = cut
    advance = window_frames if lone_end else (tokens[last - 1] - begin) * TIMESTAMP_FRAMES
    return out, max(int(advance), 1)


def decode_with_fallback(tr, features, opts, temperatures, compression_ratio_threshold, logprob_threshold,
                         no_speech_prob, no_speech_threshold, encoded=None):
    """The first decode of the window at each temperature in turn that is neither repetitive nor unlikely (or
    silent: no speech, nothing to retry); the last one when none passes. encoded: tr.encode(features[None]),
    shared by every temperature."""
    window = None
    for t in temperatures:
        o = opts if t == 0 else replace(opts, beam=1, sample=True, temperature=float(t), seed=0)
        window = tr.decode_window(features, o, encoded)
        if (no_speech_threshold is not None and no_speech_prob > no_speech_threshold
                and logprob_threshold is not None and window.avg_logprob < logprob_threshold):
            return window                                          # silence: no fallback helps
        repetitive = compression_ratio_threshold is not None and window.compression_ratio > compression_ratio_threshold
        unlikely = logprob_threshold is not None and window.avg_logprob < logprob_threshold
        if not (repetitive or unlikely):
            return window
    return window


def check(task: str, temperatures, language, tr) -> tuple:
    """InputError for a task or temperatures that cannot be; the temperatures as a tuple starting the schedule."""
    if task not in TASKS:
        raise InputError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    temps = (temperatures,) if isinstance(temperatures, (int, float)) else tuple(temperatures)
    if not temps or any(not isinstance(t, (int, float)) or not 0 <= t <= 100 for t in temps):
        raise InputError(f"temperatures must be numbers in [0, 100] (0: greedy or beam), got {temperatures!r}")
    if language not in (None, "auto") and not tr.language_ids and language != "en":
        raise InputError(f"{tr.name} is an English-only Whisper model; drop language {language!r} (or give 'en')")
    return temps


def transcribe_samples(tr, samples: np.ndarray, language: str | None = None, task: str = "transcribe",
                       timestamps: bool = False, beam: int = 1, temperatures=TEMPERATURES,
                       compression_ratio_threshold: float | None = 2.4, logprob_threshold: float | None = -1.0,
                       no_speech_threshold: float | None = 0.6, max_new_tokens: int | None = None,
                       max_initial_timestamp: int | None = 50, initial_prompt=None,
                       condition_on_previous_text: bool = False, carry_initial_prompt: bool = False,
                       prompt_reset_on_temperature: float = 0.5):
    """The Transcription of 16 kHz mono samples by a runtime.transcribe.Transcriber `tr` (see the module
    docstring; thresholds None are off)."""
    from runtime.transcribe import Segment, Transcription

    temps = check(task, temperatures, language, tr)
    initial = [] if initial_prompt is None else tr.prompt_ids(initial_prompt)
    context = Context(initial, bool(condition_on_previous_text), bool(carry_initial_prompt),
                      float(prompt_reset_on_temperature), tr.context_limit)
    mel, content = whole_mel(samples, tr.engine.feature_shape[0])
    detected, probability = None, None
    lang = language if tr.language_ids and language != "auto" else None
    segments, seek, encoded = [], 0, None
    while seek < content:
        features = pad_or_trim(mel[:, seek:seek + 3000], 3000)
        del encoded                                                # the last window's outputs (the cross K/V of
        encoded = tr.encode(features[None])                        # every layer) freed before this window's run
        lead = context.ids()
        detect = seek == 0 and tr.language_ids and language in (None, "auto")
        first = tr.first_step(features[None], encoded) if detect or not lead else None
        if detect:
            detected, probability = tr.detect_language(features[None], first)[0]
        lang = detected or lang
        if lead and tr.no_speech is not None:
            first = tr.first_step(features[None], encoded, lead)   # no speech: read after the window's prompt
        no_speech = float(np.exp(first[0, tr.no_speech])) if tr.no_speech is not None else 0.0
        opts = tr.options(tr.prompt(lang, task, timestamps), timestamps, beam, 0.0, max_new_tokens,
                          max_initial_timestamp, context=lead)
        window = decode_with_fallback(tr, features, opts, temps, compression_ratio_threshold, logprob_threshold,
                                      no_speech, no_speech_threshold, encoded)
        frames = min(3000, content - seek)
        offset = seek * HOP_LENGTH / SAMPLING_RATE
        if (no_speech_threshold is not None and no_speech > no_speech_threshold
                and (logprob_threshold is None or window.avg_logprob < logprob_threshold)):
            seek += frames                                         # no speech here: skip the window
            continue
        pieces, advance = segments_of(tr, window.tokens, offset, frames) if timestamps else \
            ([(offset, offset + frames * HOP_LENGTH / SAMPLING_RATE, window.tokens)], frames)
        kept = [(start, end, ids, text) for start, end, ids in pieces
                for text in (tr.text_of(ids),) if text.strip() or not timestamps]
        for start, end, ids, text in kept:
            segments.append(Segment(len(segments), round(start, 3), round(end, 3), text, list(ids),
                                    window.avg_logprob, window.compression_ratio, no_speech, window.temperature, seek))
        context.add([t for p in kept for t in p[2]], window.temperature)
        seek += advance
    text = "".join(s.text for s in segments)
    return Transcription(text, lang, probability, segments, round(len(samples) / SAMPLING_RATE, 3))


__all__ = ["transcribe_samples", "segments_of", "Context", "whole_mel", "decode_with_fallback", "TEMPERATURES"]
