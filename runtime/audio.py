"""Whisper's audio front-end without torch: read a file, resample to 16 kHz mono, pad or cut to 30 s, log-mel.

The numbers are those of transformers' `WhisperFeatureExtractor` (tests/test_audio.py holds them to 1e-4):
a centred STFT (reflect padding of n_fft // 2, periodic Hann window, power spectrum), Slaney-scale mel
filters with Slaney area normalisation over 0-8 kHz, log10 of max(mel, 1e-10), the last frame dropped, a
dynamic range of 8 below the clip's maximum, then (x + 4) / 4. Reading and resampling follow
`transformers.audio_utils.load_audio(backend="soundfile")` (itself `librosa.load`): soundfile decodes, the
channels are averaged, soxr's "HQ" resamples and the result is padded or cut to ceil(n * 16000 / rate).

numpy does the arithmetic; soundfile and soxr (the `audio` extra) are imported only when a file is read, so
bundles without audio never need them.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from runtime.errors import AudioError

SAMPLING_RATE = 16000
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLING_RATE      # 480000: Whisper's encoder sees 30 s, no more, no less
N_FFT = 400                                    # 25 ms windows
HOP_LENGTH = 160                               # 10 ms hops -> 3000 frames for 30 s
MEL_SIZES = (80, 128)                          # Whisper up to large-v2: 80; large-v3 and turbo: 128
MEL_BLOCK = 500                                # STFT frames computed at once (5 s: ~6 MB of float64)
FORMATS = "WAV, FLAC, OGG (Vorbis or Opus) or MP3 file"
INSTALL = "pip install 'onnxformer[audio]'"


# ---- reading and resampling ------------------------------------------------------------------------------

def _audio_libs():
    """soundfile and soxr, or an AudioError saying which extra installs them."""
    try:
        import soundfile
        import soxr
    except ImportError as exc:
        raise AudioError(f"reading audio needs soundfile and soxr ({exc.name} is missing); {INSTALL}") from None
    return soundfile, soxr


def _formats(soundfile) -> str:
    """The formats this soundfile reads: MP3 needs libsndfile >= 1.1 (soundfile >= 0.12's wheels bundle 1.2)."""
    if "MP3" in soundfile.available_formats():
        return FORMATS
    return (f"WAV, FLAC or OGG (Vorbis or Opus) file (this libsndfile {soundfile.__libsndfile_version__} reads no "
            f"MP3: upgrade soundfile to a wheel with libsndfile >= 1.1, or convert the MP3)")


def _describe(source) -> str:
    return f"{len(source)} bytes of audio" if isinstance(source, (bytes, bytearray)) else str(source)


def _reason(exc: Exception) -> str:
    """libsndfile's reason for refusing a file, without its "Error opening <name>: " prefix (the message
    names the file already); its mp3 decoder calls a file it cannot parse absent, which it is not."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = text.split(": ", 1)[1] if text.startswith("Error opening ") and ": " in text else text
    return "not a recognised audio stream" if "does not exist" in text else text.rstrip(".")


def _decode(source, soundfile) -> tuple[np.ndarray, int]:
    """(samples [frames, channels] float32, sampling rate) of a file or its bytes; a file soundfile cannot read
    is an AudioError naming it and the formats that are read."""
    name, formats = _describe(source), _formats(soundfile)
    if not isinstance(source, (bytes, bytearray)):
        if not Path(source).exists():
            raise AudioError(f"{name} is missing; give the path of a {formats}")
        if not Path(source).is_file():
            raise AudioError(f"{name} is not a file; give the path of a {formats}")
    try:
        with soundfile.SoundFile(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source)) as f:
            rate = f.samplerate
            samples = f.read(dtype="float32", always_2d=True)
    except (RuntimeError, ValueError, TypeError, EOFError) as exc:   # LibsndfileError is a RuntimeError
        raise AudioError(f"{name} cannot be read as audio ({_reason(exc)}); give a {formats} (convert "
                         f"other formats first, e.g. `ffmpeg -i in.m4a out.wav`)") from None
    if samples.shape[0] == 0:
        raise AudioError(f"{name} holds no audio samples; give a clip at least one sample long")
    if not np.isfinite(samples).all():
        raise AudioError(f"{name} holds NaN or infinite samples; give a clip of finite samples")
    return samples, rate


def resample(audio: np.ndarray, rate: int, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """Mono float32 `audio` at `rate` resampled to `sampling_rate` with soxr's "HQ" quality, padded or cut to
    ceil(len * sampling_rate / rate) samples, as librosa.load and transformers' soundfile backend do."""
    audio = np.asarray(audio, dtype=np.float32)
    if rate == sampling_rate:
        return np.ascontiguousarray(audio)
    _, soxr = _audio_libs()
    n = math.ceil(audio.shape[-1] * sampling_rate / rate)
    out = soxr.resample(audio, rate, sampling_rate, quality="soxr_hq")
    return np.ascontiguousarray(np.pad(out, (0, max(0, n - len(out))))[:n], dtype=np.float32)


def load_audio(source: str | Path | bytes, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """The samples of an audio file (a path, or the file's bytes) as float32 mono at `sampling_rate`: the
    channels averaged, then resampled. Reads WAV, FLAC, OGG and MP3 (libsndfile >= 1.1)."""
    soundfile, _ = _audio_libs()
    samples, rate = _decode(source, soundfile)
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    return resample(mono, rate, sampling_rate)


# ---- log-mel ---------------------------------------------------------------------------------------------

def pad_or_trim(audio: np.ndarray, n_samples: int = N_SAMPLES) -> np.ndarray:
    """`audio` cut to its first `n_samples` samples, or padded with silence (zeros) at the end to that length."""
    audio = np.asarray(audio, dtype=np.float32)
    if audio.shape[-1] >= n_samples:
        return audio[..., :n_samples]
    return np.pad(audio, [(0, 0)] * (audio.ndim - 1) + [(0, n_samples - audio.shape[-1])])


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    log_step = 27.0 / np.log(6.4)
    return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-300) / 1000.0) * log_step, 3.0 * hz / 200.0)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    log_step = np.log(6.4) / 27.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(log_step * (mel - 15.0)), 200.0 * mel / 3.0)


def mel_filters(n_mels: int, n_fft: int = N_FFT, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """[n_fft // 2 + 1, n_mels] float64: triangular filters with centres evenly spaced on Slaney's mel scale
    over 0 Hz - 8 kHz, each scaled by 2 / its width in Hz (Slaney's area normalisation), as librosa's
    `filters.mel(norm="slaney")` and transformers' `mel_filter_bank(norm="slaney", mel_scale="slaney")`."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(8000.0), n_mels + 2))   # n_mels + 2 edges (Hz)
    bins = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)                           # FFT bin frequencies
    slopes = edges[None, :] - bins[:, None]                                             # [bins, n_mels + 2]
    rising = -slopes[:, :-2] / np.diff(edges)[:-1]
    falling = slopes[:, 2:] / np.diff(edges)[1:]
    return np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))


def _mel_power(audio: np.ndarray, filters: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """[n_mels, frames - 1] float64 mel power of one clip: centred frames (reflect padding), periodic Hann window,
    |STFT|^2 through the mel filters [n_mels, n_fft // 2 + 1], the last frame dropped. MEL_BLOCK frames at a time:
    the float64 frames and spectrum of a block are all that is held besides the result (a whole 60 s clip's,
    padded to 90 s, took 80 MB; an hour's, 3.5 GB), and each frame's numbers are those of the whole clip's STFT."""
    padded = np.pad(audio, n_fft // 2, mode="reflect")                                  # float32, exact copies
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop][:-1]       # [frames, n_fft], a view
    window = np.hanning(n_fft + 1)[:-1]                                                # periodic Hann
    mel = np.empty((len(filters), len(frames)))
    for start in range(0, len(frames), MEL_BLOCK):
        spectrum = np.fft.rfft(frames[start:start + MEL_BLOCK].astype(np.float64) * window, axis=-1)
        mel[:, start:start + MEL_BLOCK] = filters @ (spectrum.real ** 2 + spectrum.imag ** 2).T
    return mel


def log_mel_spectrogram(audio: np.ndarray, n_mels: int = 80, n_fft: int = N_FFT,
                        hop: int = HOP_LENGTH) -> np.ndarray:
    """[n_mels, len // hop] float32 log-mel features of one mono 16 kHz clip, WhisperFeatureExtractor's numbers
    (pad or cut to 30 s first, or call `features_for`)."""
    if n_mels not in MEL_SIZES:
        raise AudioError(f"n_mels {n_mels} is not a Whisper size; use 80 (up to large-v2) or 128 (large-v3)")
    audio = np.asarray(audio, dtype=np.float32)     # the extractor rounds float64 input to float32 too
    if audio.ndim != 1 or audio.shape[0] <= n_fft // 2:
        raise AudioError(f"log-mel needs one mono clip longer than {n_fft // 2} samples, got shape "
                         f"{audio.shape}; pad it with pad_or_trim first")
    log_spec = _mel_power(audio, mel_filters(n_mels, n_fft).T, n_fft, hop)   # Whisper drops the last frame
    np.log10(np.maximum(log_spec, 1e-10, out=log_spec), out=log_spec)          # in place: one [n_mels, frames]
    np.maximum(log_spec, log_spec.max() - 8.0, out=log_spec)  # at most 8 (80 dB) below the clip's loudest
    log_spec += 4.0
    log_spec /= 4.0
    return log_spec.astype(np.float32)


def _samples(audio) -> np.ndarray:
    """16 kHz mono samples of a path, the bytes of a file, or an array (taken as 16 kHz mono already)."""
    if isinstance(audio, (str, Path, bytes, bytearray)):
        return load_audio(audio)
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise AudioError(f"audio samples must be one mono 16 kHz channel, got shape {audio.shape}; "
                         "average the channels (audio.mean(axis=...)) or use load_audio")
    if audio.size == 0:
        raise AudioError("the audio holds no samples; give a clip at least one sample long")
    return audio


def features_for(audio, n_mels: int = 80) -> np.ndarray:
    """[1, n_mels, 3000] float32 encoder input of one clip (a path, file bytes, or 16 kHz mono samples): the
    first 30 s, padded with silence."""
    return log_mel_spectrogram(pad_or_trim(_samples(audio)), n_mels)[None]


def batch_features(audios, n_mels: int = 80) -> np.ndarray:
    """[len(audios), n_mels, 3000] float32: `features_for` of each clip, stacked (each clip's own range)."""
    audios = list(audios)
    if not audios:
        raise AudioError("no audio clips given; give at least one")
    return np.stack([log_mel_spectrogram(pad_or_trim(_samples(a)), n_mels) for a in audios])
