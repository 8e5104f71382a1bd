"""runtime.audio: Whisper's log-mel features equal transformers' WhisperFeatureExtractor's (max abs error
<= 1e-4, the fp32 CPU row of the tolerance table), files of each format read as 16 kHz mono, bad files refused.

The reference is the extractor as transformers runs it here (its torch STFT, torch being installed), on the
same 16 kHz samples; reading and resampling equal transformers' own soundfile + soxr loader sample for sample.
"""

from __future__ import annotations

import math
import shutil
import subprocess

import numpy as np
import pytest

soundfile = pytest.importorskip("soundfile")
pytest.importorskip("soxr")
transformers = pytest.importorskip("transformers")
from transformers.audio_utils import load_audio as hf_load_audio, mel_filter_bank  # noqa: E402

from runtime.audio import (N_SAMPLES, batch_features, features_for, load_audio, log_mel_spectrogram,  # noqa: E402
                           mel_filters, pad_or_trim)
from runtime.errors import AudioError  # noqa: E402

SR = 16000
ATOL = 1e-4                                    # fp32 / CPU in the design's tolerance table
SPEECH = "The quick brown fox jumps over the lazy dog. Whisper hears every word of this sentence."


@pytest.fixture(scope="module")
def extractors():
    return {n: transformers.WhisperFeatureExtractor(feature_size=n) for n in (80, 128)}


def reference(extractor, audio: np.ndarray) -> np.ndarray:
    return extractor(audio, sampling_rate=SR, return_tensors="np").input_features


def assert_features_match(extractor, audio: np.ndarray, n_mels: int) -> float:
    """Our [1, n_mels, 3000] features against the extractor's on the same samples; returns the max abs error."""
    ours, ref = features_for(audio, n_mels), reference(extractor, audio)
    assert ours.shape == ref.shape == (1, n_mels, 3000) and ours.dtype == np.float32
    assert ref.std() > 0.05 and np.unique(ref).size > 100           # a reference that varies: the check can fail
    error = float(np.abs(ours - ref).max())
    where = np.unravel_index(np.abs(ours - ref).argmax(), ref.shape)
    assert error <= ATOL, f"max abs error {error:.3g} at {where}: ours {ours[where]}, extractor {ref[where]}"
    # what is left is torch's float32 STFT near the 8-below-max floor: the extractor's own float64 numpy path
    # (used where torch is absent) gives our numbers to the last float32 bits
    numpy_path = extractor._np_extract_fbank_features(pad_or_trim(audio)[None], "cpu")
    assert np.abs(ours - numpy_path).max() <= 1e-6
    return error


def tone(seconds: float, rate: int, freqs=(440.0,), amp=0.3, noise=0.01, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    signal = sum(amp * np.sin(2 * np.pi * f * t) for f in freqs) + noise * rng.standard_normal(t.size)
    return signal.astype(np.float32)


def chirp_and_noise(seconds: float = 20.0) -> np.ndarray:
    """A sweep over the whole band (100 Hz - 7.9 kHz) over white noise: every mel bin sees signal."""
    t = np.arange(int(seconds * SR)) / SR
    sweep = 0.5 * np.sin(2 * np.pi * (100 * t + 0.5 * (7900 - 100) / seconds * t ** 2))
    return (sweep + 0.05 * np.random.default_rng(1).standard_normal(t.size)).astype(np.float32)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_equal_transformers(n_mels):
    expected = mel_filter_bank(num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0,
                               max_frequency=8000.0, sampling_rate=SR, norm="slaney", mel_scale="slaney")
    assert np.abs(mel_filters(n_mels) - expected).max() <= 1e-12


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("case", ["chirp+noise 20 s", "2 s padded", "35 s cut"])
def test_log_mel_equals_whisper_feature_extractor(extractors, n_mels, case):
    audio = {"chirp+noise 20 s": chirp_and_noise,
             "2 s padded": lambda: tone(2.0, SR, freqs=(440.0, 3100.0)),
             "35 s cut": lambda: np.concatenate([chirp_and_noise(30.0), tone(5.0, SR, amp=0.9, seed=2)])}[case]()
    assert_features_match(extractors[n_mels], audio, n_mels)
    if audio.size > N_SAMPLES:      # the cut keeps the first 30 s: the last 5 s (a loud tone) change nothing
        assert np.array_equal(features_for(audio, n_mels), features_for(audio[:N_SAMPLES], n_mels))
        assert not np.array_equal(features_for(audio, n_mels), features_for(audio[-N_SAMPLES:], n_mels))


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """A spoken sentence from espeak-ng (22.05 kHz WAV), where it is installed (Debian: espeak-ng)."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng): no real speech to check")
    path = tmp_path_factory.mktemp("speech") / "speech.wav"
    subprocess.run([espeak, "-w", str(path), SPEECH], check=True, capture_output=True, timeout=60)
    return path


@pytest.mark.parametrize("n_mels", [80, 128])
def test_real_speech_equals_whisper_feature_extractor(extractors, speech, n_mels):
    assert soundfile.info(str(speech)).samplerate != SR                 # resampled on the way in
    audio = load_audio(speech)
    assert np.array_equal(audio, hf_load_audio(str(speech), sampling_rate=SR, backend="soundfile"))
    assert_features_match(extractors[n_mels], audio, n_mels)


def test_a_long_clip_s_log_mel_is_computed_in_blocks_with_the_same_numbers(monkeypatch):
    """Two minutes of audio (24 blocks of STFT frames): every number equals the whole-clip computation's, and the
    float64 temporaries held at once are a block's, not the clip's (a quarter of the whole clip's at most)."""
    import tracemalloc

    import runtime.audio as audio

    clip = tone(120.0, SR, freqs=(220.0, 1250.0), noise=0.05)
    tracemalloc.start()
    blocked = log_mel_spectrogram(clip, 80)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    monkeypatch.setattr(audio, "MEL_BLOCK", 10**9)          # one block: the whole clip's STFT at once
    tracemalloc.start()
    whole = log_mel_spectrogram(clip, 80)
    whole_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert blocked.shape == (80, 12000) and blocked.std() > 0.05
    assert np.array_equal(blocked, whole)
    # besides the float32 result (3.8 MB): the padded samples and the float64 mel (2x and 2x that), one block's
    assert peak < 6 * blocked.nbytes and whole_peak > 4 * peak, (peak, whole_peak)


def test_batch_features_stack_each_clip(extractors):
    clips = [tone(2.0, SR, freqs=(440.0, 3100.0)), chirp_and_noise(), tone(7.0, SR, freqs=(250.0,), seed=3)]
    batch = batch_features(clips, 128)
    assert batch.shape == (3, 128, 3000) and batch.dtype == np.float32
    for row, clip in zip(batch, clips):
        assert np.array_equal(row, features_for(clip, 128)[0])       # each clip keeps its own dynamic range
    assert np.abs(batch - reference(extractors[128], clips)).max() <= ATOL


def test_pad_or_trim():
    assert np.array_equal(pad_or_trim(np.ones(5, np.float32), 8), [1, 1, 1, 1, 1, 0, 0, 0])
    assert np.array_equal(pad_or_trim(np.arange(10, dtype=np.float32), 4), [0, 1, 2, 3])
    assert pad_or_trim(np.zeros(N_SAMPLES + 7)).shape == (N_SAMPLES,)


FORMATS = [("wav", "PCM_16", 44100), ("wav", "FLOAT", 8000), ("flac", "PCM_16", 44100), ("flac", "PCM_24", 8000),
           ("ogg", "VORBIS", 44100), ("ogg", "OPUS", 8000), ("mp3", "MPEG_LAYER_III", 44100),
           ("mp3", "MPEG_LAYER_III", 8000)]
LOSSLESS = {"PCM_16", "PCM_24", "FLOAT"}


def stereo(rate: int, seconds: float = 2.5) -> np.ndarray:
    """Left 440 Hz, right 1 kHz: the mono mix holds both at half their amplitude."""
    return np.stack([tone(seconds, rate, (440.0,), amp=0.5, noise=0), tone(seconds, rate, (1000.0,), amp=0.4,
                                                                            noise=0)], axis=1)


@pytest.mark.parametrize("ext, subtype, rate", FORMATS, ids=[f"{e}-{s}-{r}" for e, s, r in FORMATS])
def test_files_read_as_16k_mono(extractors, tmp_path, ext, subtype, rate):
    if ext == "mp3" and "MP3" not in soundfile.available_formats():
        pytest.skip(f"libsndfile {soundfile.__libsndfile_version__} reads no MP3 (needs >= 1.1)")
    path = tmp_path / f"clip.{ext}"
    soundfile.write(str(path), stereo(rate), rate, subtype=subtype)
    audio = load_audio(path)
    frames = soundfile.info(str(path)).frames
    assert audio.dtype == np.float32 and audio.shape == (math.ceil(frames * SR / rate),)
    assert np.array_equal(audio, hf_load_audio(str(path), sampling_rate=SR, backend="soundfile"))
    assert np.array_equal(audio, load_audio(path.read_bytes()))          # the file's bytes read the same
    # the mix, resampled: both tones at half amplitude (lossless files: sample for sample away from the edges)
    expected = (stereo(SR).mean(axis=1))[:audio.size]
    if subtype in LOSSLESS:
        assert np.abs(audio - expected)[SR // 10:-SR // 10].max() < 2e-3
    spectrum = np.abs(np.fft.rfft(audio[:2 * SR])) / (2 * SR)            # 0.5 Hz bins over 2 s: A / 2
    assert spectrum[880] == pytest.approx(0.125, abs=0.02) and spectrum[2000] == pytest.approx(0.1, abs=0.02)
    assert_features_match(extractors[80], audio, 80)
    assert np.array_equal(features_for(path, 80), features_for(audio, 80))


def write_nan_wav(path):
    soundfile.write(str(path), np.array([0.1, np.nan, 0.2], np.float32), SR, subtype="FLOAT")


BAD = {   # name -> (how to make it, what the message says)
    "missing.wav": (None, "is missing"),
    "header.wav": (lambda p: p.write_bytes(b"RIFF\0\0\0\0WAVEjunkjunkjunk"), "cannot be read as audio"),
    "text.mp3": (lambda p: p.write_text("not audio at all\n" * 20), "not a recognised audio stream"),
    "song.m4a": (lambda p: p.write_bytes(b"\0\0\0\x18ftypM4A \0\0\2\0isomiso2" + bytes(200)), "Format not recog"),
    "cut.flac": (lambda p: p.write_bytes(b"fLaC" + bytes(300)), "cannot be read as audio"),
    "empty.wav": (lambda p: soundfile.write(str(p), np.zeros((0, 1), np.float32), SR), "holds no audio samples"),
    "nan.wav": (write_nan_wav, "NaN or infinite"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_files_are_audio_errors(tmp_path, name):
    make, says = BAD[name]
    path = tmp_path / name
    if make:
        make(path)
    with pytest.raises(AudioError) as caught:
        load_audio(path)
    message = str(caught.value)
    assert str(path) in message and says in message and "\n" not in message
    if "cannot be read" in message or "missing" in message:
        assert "WAV, FLAC, OGG" in message                        # the fix: the formats that are read


def test_bad_inputs_are_audio_errors(tmp_path):
    with pytest.raises(AudioError, match="bytes of audio cannot be read as audio"):
        load_audio(b"garbage" * 10)
    with pytest.raises(AudioError, match="is not a file"):
        load_audio(tmp_path)
    with pytest.raises(AudioError, match="one mono 16 kHz channel"):
        features_for(np.zeros((2, SR), np.float32))
    with pytest.raises(AudioError, match="holds no samples"):
        features_for(np.zeros(0, np.float32))
    with pytest.raises(AudioError, match="use 80 .* or 128"):
        log_mel_spectrogram(np.zeros(N_SAMPLES, np.float32), n_mels=64)
    with pytest.raises(AudioError, match="no audio clips"):
        batch_features([])
