"""Parity of a Whisper bundle or checkpoint against the WhisperForConditionalGeneration it was imported from
(`onnxformer parity WHISPER_DIR BUNDLE`; toolkit/parity/original.py hands Whisper directories here).

    report = whisper_parity("whisper-tiny/", engine, tokenizer=bundle.tokenizer, samples=16)

checks, on the speech clips given (`--audio FILES|DIR`), else seeded random log-mel features
(toolkit.parity.inputs.choose_inputs: not speech, so the report says they are not representative):
- logits: the reference model imported in memory vs the original, teacher-forced, max abs error <= 1e-5 (float64
  where float32 rounding alone exceeds it);
- tokens: the engine's best hypotheses (greedy, beam K) vs transformers' own search of the original over the same
  30 s window (whisper_generate): GenerationMixin.generate, the greedy / beam loop that
  WhisperForConditionalGeneration.generate runs each window in, given what that generate would force and suppress
  for language=..., task="transcribe" without timestamps: the prompt as its generation config spells it
  (whisper_prompt: <|startoftranscript|> <|lang|> <|transcribe|> <|notimestamps|>, the language the first of the
  model's, "en" where it has it; <|startoftranscript|> <|notimestamps|> for an English-only model), which must
  equal the engine's (runtime.speech.prompt_ids), and the generation config's suppress_tokens and
  begin_suppress_tokens (timestamp ids are not suppressed: transformers suppresses none when no timestamps are
  asked), beam with early_stopping="never" (runtime.search's exact stopping rule, as toolkit/parity/original.py sets
  it for every other family), judged by the token rule (reference outputs must vary).

Why not WhisperForConditionalGeneration.generate itself: even for one window (<= 30 s) it runs its long-form seek
loop (transformers 5.25, generation_whisper.py: `while (seek < max_frames).any()`), cuts each output at its
timestamp tokens (_retrieve_segment) and moves the seek to the last timestamp pair's time. A model that emits a
timestamp pair after <|notimestamps|> at <|0.00|> moves it by 0 frames and decodes the same window forever (the
speech-trained tiny Whisper does on 6 of its 24 held-out clips, greedy; tests/test_whisper_parity_seek.py builds
such a model); one with a pair elsewhere gets the window decoded again from there and the pieces joined. Where its
loop ends after one pass the ids are the same (tests/test_families_whisper.py), but that it drops the end token of
each batch's longest outputs (it strips every output's end token and pads the batch with it).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from runtime.errors import InputError
from runtime.generate import generate_ids
from runtime.search import SearchOptions
from runtime.speech import prompt_ids
from toolkit.parity.generation import compare_tokens
from toolkit.parity.inputs import choose_inputs
from toolkit.parity.report import token_verdict
from toolkit.parity.tolerances import IMPORTED

BATCH = 16                          # features per original forward / generate (each [80, 3000])
TARGET_TOKENS = 8


def whisper_logits(model, reference, features: np.ndarray, seed: int = 0):
    """OriginalCheck of teacher-forced logits: the original vs the imported reference model."""
    import torch

    from toolkit.parity.original import OriginalCheck, ok_or_failed

    c = reference.config
    feats = torch.from_numpy(features[:BATCH])
    tgt = torch.from_numpy(np.random.default_rng(seed).integers(0, c.vocab_size, (len(feats), TARGET_TOKENS)))
    tgt[:, 0] = c.bos_id

    def error(hf, ours, x):
        with torch.no_grad():
            want = hf(input_features=x, decoder_input_ids=tgt).logits
            _, cross = ours.encode(x, None)
            got, _ = ours.decode_step(tgt, torch.ones(len(x), c.source_positions), ours.empty_cache(
                len(x), dtype=x.dtype), cross)
        return want, float((want - got).abs().max())

    want, err = error(model, reference, feats)
    varied, where = float(want.std()) > 1e-3, f"{len(feats)} feature inputs x {TARGET_TOKENS} target tokens"
    if err > IMPORTED.atol:                            # float32 rounding alone, or the import: float64 decides
        _, err64 = error(copy.deepcopy(model).double(), copy.deepcopy(reference).double(), feats.double())
        return OriginalCheck("logits", ok_or_failed(err64 <= IMPORTED.atol, varied),
                             f"max abs error {err64:.2e} in float64 (limit {IMPORTED.atol:.0e}, {where}); float32: "
                             f"{err:.2e}", err64, IMPORTED.atol)
    return OriginalCheck("logits", ok_or_failed(True, varied), f"max abs error {err:.2e} (limit "
                         f"{IMPORTED.atol:.0e}, {where})", err, IMPORTED.atol)


def whisper_prompt(generation_config, language: str | None) -> list[int]:
    """The decoder ids WhisperForConditionalGeneration.generate(language=..., task="transcribe") forces without
    timestamps, from its generation config: <|startoftranscript|> <|lang|> <|transcribe|> <|notimestamps|> (no
    language, an English-only model: <|startoftranscript|> <|notimestamps|>)."""
    gc = generation_config
    spoken = [gc.lang_to_id[f"<|{language}|>"], gc.task_to_id["transcribe"]] if language else []
    return [gc.decoder_start_token_id, *spoken, gc.no_timestamps_token_id]


def whisper_generate(model, features: np.ndarray, prompt: list[int], beam: int, max_new_tokens: int):
    """transformers' search (GenerationMixin.generate, greedy or beam, no sampling; beam with
    early_stopping="never", runtime.search's exact stopping rule, as every family's parity sets it) of the original
    after `prompt` with its generation config's suppressed ids; each output's ids after the prompt, cut after the
    first end token."""
    import torch
    from transformers import GenerationMixin

    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=max_new_tokens, num_beams=beam, do_sample=False, num_return_sequences=1,
                  early_stopping="never")
    eos, out = config.eos_token_id, []
    for start in range(0, len(features), BATCH):
        batch = torch.from_numpy(features[start:start + BATCH])
        with torch.no_grad():
            gen = GenerationMixin.generate(model, batch, generation_config=config,
                                           decoder_input_ids=torch.tensor([prompt] * len(batch)))
        rows = gen[:, len(prompt):].tolist()
        out += [row[: row.index(eos) + 1] if eos in row else row for row in rows]
    return out


def whisper_parity(original: str | Path, engine, candidate: str = "", texts=None, samples: int = 100,
                   beams=(1, 4), max_new_tokens: int = 32, tokenizer=None, token_match: float = 1.0, progress=None,
                   audio=None):
    """Compare an engine (bundle or checkpoint) with the Whisper model it was imported from, on audio clips' log-mel
    features (audio: files or directories) or seeded random ones."""
    from toolkit.parity.original import OriginalReport, original_of
    from toolkit.reference.importers import reference_of

    progress = progress or (lambda msg: None)
    if texts:
        raise InputError("--input gives texts, but a Whisper model reads audio; give speech clips with --audio "
                         "FILES|DIR instead, or leave --input out (parity uses random log-mel features)")
    if tokenizer is None or not tokenizer.spec.get("decoder_prompt"):
        raise InputError(f"{candidate or 'the candidate'} has no Whisper tokenizer, so its prompt is unknown; "
                         f"import the Whisper directory with its tokenizer.json")
    family = original_of(original)
    model, _ = family.load_original(Path(original))
    ours = reference_of(original)
    inputs = choose_inputs(ours.config, None, samples, audio=audio, option="--audio")
    features = np.stack(inputs.seqs)
    report = OriginalReport(str(original), candidate, len(features), inputs.source, reference=family.original,
                            representative=inputs.representative, family=family.name)
    progress(f"logits: {family.original} vs the imported reference model")
    report.checks.append(whisper_logits(model, ours, features))
    language = "en" if "en" in tokenizer.languages else (tokenizer.languages[0] if tokenizer.languages else None)
    progress(f"tokens: transformers' search of the original over one window vs {candidate or 'the engine'} "
             f"(beams {', '.join(map(str, beams))})")
    report.checks += whisper_tokens(model, engine, features, prompt_ids(tokenizer, language), language, beams,
                                    max_new_tokens, token_match, family.name)
    return report


def whisper_tokens(model, engine, features: np.ndarray, prefix, language: str | None, beams, max_new_tokens: int,
                   token_match: float, family: str = "whisper") -> list:
    """OriginalChecks of the engine's best hypotheses after its prompt (<start> + prefix) vs whisper_generate's
    after the original's (whisper_prompt), greedy and each beam width (a first mismatch keyed by `family` and
    "onnxformer", as OriginalReport shows it); a prompt of the engine's that is not the original's fails a check of
    its own."""
    from toolkit.parity.original import OriginalCheck

    prefix, prompt, checks = tuple(prefix), whisper_prompt(model.generation_config, language), []
    if prompt != [engine.bos_id, *prefix]:
        checks.append(OriginalCheck("prompt", "failed", f"the original forces {prompt} for language {language}, the "
                                    f"engine's prompt is {[engine.bos_id, *prefix]}: re-import the Whisper directory"))
    max_new_tokens = min(max_new_tokens, engine.max_len - len(prefix) - 1)
    for beam in beams:
        ref = whisper_generate(model, features, prompt, beam, max_new_tokens)
        opts = SearchOptions(max_new_tokens=max_new_tokens, beam=beam, prefix_ids=(prefix,) * len(features))
        got = [h[0].tokens[len(prefix):] for h in generate_ids(engine, list(features), opts)]
        _, tok_eq, first = compare_tokens(ref, got)
        if first is not None:
            first = {"index": first["index"], "position": first["position"], family: first["pytorch"],
                     "onnxformer": first["onnxruntime"]}
        distinct = len({tuple(r) for r in ref})
        verdict = token_verdict(tok_eq, token_match, distinct, len(features))
        checks.append(OriginalCheck("greedy" if beam == 1 else f"beam {beam}", verdict,
                                    f"{tok_eq:.2%} tokens identical ({distinct} distinct; prompt language "
                                    f"{language})", tok_eq, token_match, distinct, first))
    return checks


__all__ = ["whisper_parity", "whisper_logits", "whisper_generate", "whisper_prompt", "whisper_tokens"]
