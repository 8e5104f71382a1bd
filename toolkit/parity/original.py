"""Parity against the original framework: an imported model, and bundles made from it, against the transformers
model it was imported from (MarianMTModel, BartForConditionalGeneration, ...: the registered family's original).

    report = marian_parity("opus-mt-en-de/", engine, texts=None, samples=64)   # engine: bundle or checkpoint

checks, on the same batched and padded inputs:
- tokenizer: our tokenizer's ids equal the original's (for text inputs);
- logits: the reference model imported in memory vs the original, teacher-forced, max abs error <= 1e-5
  (the IMPORTED row: PyTorch vs PyTorch);
- tokens: the engine's greedy and beam-K best hypotheses vs the original's generate with the same settings
  (num_beams, length_penalty, max_new_tokens, early_stopping="never": the exact stopping rule of runtime.search;
  bad_words_ids = [[pad]] where decoding starts from pad (Marian, Pegasus; not T5, whose generate may emit pad:
  GENERATES_PAD); sampling, forced first and last
  tokens, repetition rules and the rest off), identical for fp32 (the bundle's token row otherwise), judged by the token rule every parity uses (report.token_verdict): the
  reference outputs must vary, or equal tokens are "inconclusive", never "ok"; random piece ids (no texts given)
  are said not to be representative.
The original is loaded by its registered family (toolkit/reference/importers), which imports transformers
only when a parity against the original is asked for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from runtime.errors import InputError
from runtime.generate import generate_ids, pad_batch
from runtime.search import SearchOptions
from toolkit.parity.generation import compare_tokens
from toolkit.parity.inputs import DEFAULT_SAMPLES, input_kind, not_representative
from toolkit.parity.report import Report, combine, mismatch_window, needed_distinct, shout, token_verdict
from toolkit.parity.tolerances import IMPORTED, Tolerance


def ok_or_failed(ok: bool, varied: bool = True) -> str:
    """A check's verdict; a reference that does not vary proves nothing either way (inconclusive)."""
    return "inconclusive" if not varied else "ok" if ok else "failed"


@dataclass
class OriginalCheck:
    what: str                       # "tokenizer" | "logits" | "greedy" | "beam 4"
    verdict: str                    # "ok" | "failed" | "inconclusive"
    detail: str
    value: float | None = None      # max abs error or fraction equal
    limit: float | None = None
    distinct_outputs: int | None = None
    first_mismatch: dict | None = None

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


@dataclass
class OriginalReport(Report):
    original: str
    candidate: str
    samples: int
    source: str
    checks: list[OriginalCheck] = field(default_factory=list)
    reference: str = "the original"             # its family's name for it: "MarianMTModel (transformers)"
    representative: bool = True     # False: random piece ids (a text model never sees them)
    family: str = "original"        # the registered family ("marian", "m2m100"): the original's key in mismatches

    @property
    def verdict(self) -> str:
        return combine(c.verdict for c in self.checks)

    def summary(self) -> str:
        line = f"parity with the original {shout(self.verdict)}: " + "; ".join(f"{c.what} {c.detail}"
                                                                              for c in self.checks)
        first = next((c for c in self.checks if c.verdict == "failed" and c.what not in ("tokenizer", "logits")
                      and c.first_mismatch), None)
        if first is not None:
            window = mismatch_window(first.first_mismatch, "onnxformer", self.family)
            line += f"; first mismatch ({first.what}): {window}"
        return line if self.representative else f"{line}; {not_representative(self.source)}"

    def table(self) -> str:
        lines = [f"{'check':<10} {'value':>12} {'limit':>10} {'distinct':>8}  verdict", "-" * 56]
        for c in self.checks:
            value = "-" if c.value is None else (f"{c.value:.2e}" if c.what in ("logits",) else f"{c.value:.2%}")
            limit = "-" if c.limit is None else (f"{c.limit:.0e}" if c.what in ("logits",) else f"{c.limit:.0%}")
            lines.append(f"{c.what:<10} {value:>12} {limit:>10} {c.distinct_outputs or '-':>8}  {c.verdict}")
        lines.append(f"inputs: {self.source}" + ("" if self.representative else f" (NOT representative: this model "
                                                                                  f"reads {input_kind(self.source)})")
                     + f"; reference: {self.reference} from {self.original}")
        return "\n".join(lines)

    def fields(self) -> dict:
        return {"original": self.original, "family": self.family, "candidate": self.candidate,
                "samples": self.samples, "source": self.source, "representative": self.representative,
                "checks": [c.to_dict() for c in self.checks]}


def original_of(path: str | Path):
    """The registered family that loads the original at path (a model directory) for parity."""
    from toolkit.reference.importers import original_family

    family = original_family(path)
    if family is None:
        raise InputError(f"{path} is not a model directory whose original onnxformer can load for parity")
    return family


def load_original(path: str | Path):
    """(the original model in eval mode, its tokenizer) of a model directory, loaded by its registered family."""
    return original_of(path).load_original(Path(path))


def marian_inputs(tok, ours, texts: list[str] | None, samples: int, seed: int = 0, max_len: int = 24,
                  family: str = "original") -> tuple[list[list[int]], str, OriginalCheck | None]:
    """Source ids: texts tokenized by the original's tokenizer (checked against ours), else random piece ids;
    a tokenizer mismatch names the original's ids by `family`."""
    if samples < 1:
        raise InputError(f"--samples must be at least 1, got {samples}")
    if texts:
        texts = texts[:samples]
        ref = [tok(t)["input_ids"] for t in texts]
        check = None
        if ours is not None:
            got = [ours.encode(t) for t in texts]
            same = sum(a == b for a, b in zip(ref, got))
            bad = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
            check = OriginalCheck("tokenizer", ok_or_failed(same == len(ref)),
                                  f"{same}/{len(ref)} inputs tokenized identically", same / len(ref), 1.0,
                                  first_mismatch=None if bad is None else
                                  {"index": bad, "text": texts[bad], family: ref[bad], "onnxformer": got[bad]})
        return ref, f"{len(texts)} texts", check
    special = set(tok.all_special_ids)
    ids = [i for i in range(tok.vocab_size) if i not in special]       # the base vocabulary, added tokens aside
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len + 1, size=samples)
    seqs = [[ids[j] for j in rng.integers(0, len(ids), size=int(n))] + [tok.eos_token_id] for n in lens]
    return seqs, f"{samples} random piece sequences (+ EOS), lengths 2..{max_len + 1}", None


def hf_pad(model) -> int:
    """The id MarianTokenizer pads sources with (pad, inside the source vocabulary)."""
    c = model.config
    return c.pad_token_id if c.pad_token_id < c.vocab_size else 0


GENERATES_PAD = ("t5", "mt5")   # model types that decode from pad and may generate it (the import's suppress_pad false)


def suppresses_pad(config) -> bool:
    """Whether the original's generate is run with pad banned: where decoding starts from pad, as the reference
    model's suppress_pad (Marian, Pegasus), except for the model types that generate pad themselves."""
    return config.decoder_start_token_id == config.pad_token_id and config.model_type not in GENERATES_PAD


def hf_generate(model, seqs: list[list[int]], beam: int, max_new_tokens: int, length_penalty: float = 1.0,
                batch: int = 64, forced_bos: int | None = None) -> list[list[int]]:
    """The original's generate: best hypothesis per input, start token dropped, cut after the first EOS; pad is
    never generated where decoding starts from it (the reference model's suppress_pad); forced_bos: the first
    token (forced_bos_token_id: mBART-50's and NLLB's target language), else none is forced; EOS is forced at the
    length limit where the model's own generation config says so (forced_eos_token_id, which import reads into
    the reference model's forced_eos)."""
    import torch
    from transformers import GenerationConfig

    c = model.config
    gc = GenerationConfig(num_beams=beam, length_penalty=length_penalty, max_new_tokens=max_new_tokens,
                          do_sample=False, early_stopping="never", num_return_sequences=1,
                          bad_words_ids=[[c.pad_token_id]] if suppresses_pad(c) else None,
                          decoder_start_token_id=c.decoder_start_token_id,
                          eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
                          forced_eos_token_id=getattr(model.generation_config, "forced_eos_token_id", None),
                          forced_bos_token_id=forced_bos, no_repeat_ngram_size=0, repetition_penalty=1.0, min_length=0,
                          use_cache=True)
    out = []
    for start in range(0, len(seqs), batch):
        ids, mask = pad_batch(seqs[start:start + batch], hf_pad(model))
        with torch.no_grad():
            gen = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                 generation_config=gc)
        for row in gen[:, 1:].tolist():
            out.append(row[: row.index(c.eos_token_id) + 1] if c.eos_token_id in row else row)
    return out


def logits_check(model, reference, seqs: list[list[int]], steps: int = 8, seed: int = 0,
                 tolerance: Tolerance = IMPORTED) -> OriginalCheck:
    """Teacher-forced logits of the reference (our PyTorch model) vs MarianMTModel on padded batches.

    Judged in float32; where float32 misses the limit, judged again with float64 copies of both models, which
    separates the import from rounding: a trained model's logits reach ~20, and there MarianMTModel's own float32
    logits are ~5e-5 from its float64 ones (RESULTS.md, "The imported model vs MarianMTModel in float32"), so two float32 implementations of
    one function cannot agree to 1e-5, while a mapping mistake stays as large in float64. The detail says which."""
    import copy

    import torch

    c = model.config
    ids, mask = pad_batch(seqs[:64], hf_pad(model))
    rng = np.random.default_rng(seed)
    # target tokens other than pad: a decoder reads pad only where generation ended, and M2M100 positions a pad
    # inside a sequence differently (toolkit/reference/importers/m2m100.py)
    tgt = rng.integers(0, (getattr(c, "decoder_vocab_size", None) or c.vocab_size) - 1, size=(len(ids), steps))
    tgt[tgt >= c.pad_token_id] += 1
    tgt[:, 0] = c.decoder_start_token_id
    ids_t, mask_t, tgt_t = (torch.from_numpy(a) for a in (ids, mask, tgt))
    with torch.no_grad():
        want = model(input_ids=ids_t, attention_mask=mask_t, decoder_input_ids=tgt_t).logits
        got = reference(ids_t, mask_t, tgt_t)
    err = float((want - got).abs().max())
    varied = float(want.std()) > 1e-3
    where = f"{len(ids)} padded inputs x {steps} target tokens"
    if err <= tolerance.atol:
        return OriginalCheck("logits", ok_or_failed(True, varied),
                             f"max abs error {err:.2e} (limit {tolerance.atol:.0e}, {where})", err, tolerance.atol)
    with torch.no_grad():
        want64 = copy.deepcopy(model).double()(input_ids=ids_t, attention_mask=mask_t, decoder_input_ids=tgt_t).logits
        got64 = copy.deepcopy(reference).double()(ids_t, mask_t, tgt_t)
    err64, noise = float((want64 - got64).abs().max()), float((want.double() - want64).abs().max())
    return OriginalCheck("logits", ok_or_failed(err64 <= tolerance.atol, varied),
                         f"max abs error {err64:.2e} in float64 (limit {tolerance.atol:.0e}, {where}); float32: "
                         f"{err:.2e}, rounding: the original's own float32 logits are {noise:.2e} from float64 "
                         f"(largest |logit| {float(want64.abs().max()):.1f})", err64, tolerance.atol)


def token_checks(model, engine, seqs: list[list[int]], beams=(1, 4), max_new_tokens: int = 32,
                 length_penalty: float = 1.0, token_match: float = 1.0,
                 family: str = "original") -> list[OriginalCheck]:
    """Best hypotheses of the engine vs the original's generate, per search; needs varied reference outputs. A
    first mismatch names the original's tokens by `family`."""
    checks = []
    for beam in beams:
        ref = hf_generate(model, seqs, beam, max_new_tokens, length_penalty)
        opts = SearchOptions(max_new_tokens=max_new_tokens, beam=beam, length_penalty=length_penalty)
        got = [h[0].tokens for start in range(0, len(seqs), 64)
               for h in generate_ids(engine, seqs[start:start + 64], opts)]
        seq_eq, tok_eq, first = compare_tokens(ref, got)
        distinct = len({tuple(r) for r in ref})
        name = "greedy" if beam == 1 else f"beam {beam}"
        if first is not None:
            first = {"index": first["index"], "position": first["position"], family: first["pytorch"],
                     "onnxformer": first["onnxruntime"]}
        verdict = token_verdict(tok_eq, token_match, distinct, len(seqs))
        detail = f"{seq_eq:.2%} sequences, {tok_eq:.2%} tokens identical ({distinct} distinct)"
        if tok_eq >= token_match and verdict == "inconclusive":
            detail = (f"inconclusive: only {distinct} distinct reference outputs (needs "
                      f"{needed_distinct(len(seqs)):g}); use inputs whose translations differ")
        checks.append(OriginalCheck(name, verdict, detail, tok_eq, token_match, distinct, first))
    return checks


def marian_parity(original: str | Path, engine, candidate: str = "", texts: list[str] | None = None,
                  samples: int = DEFAULT_SAMPLES, beams=(1, 4), max_new_tokens: int = 32, length_penalty: float = 1.0,
                  tokenizer=None, token_match: float = 1.0, progress=None, audio=None) -> OriginalReport:
    """Compare an engine (bundle or checkpoint) with the Marian model it was imported from (audio: a Whisper
    model's clips, original_whisper)."""
    from toolkit.reference.importers import reference_of

    progress = progress or (lambda msg: None)
    family = original_of(original)
    if family.name == "whisper":                       # audio inputs: its own checks (original_whisper.py)
        from toolkit.parity.original_whisper import whisper_parity

        return whisper_parity(original, engine, candidate, texts, samples, beams, max_new_tokens, tokenizer,
                              token_match, progress, audio)
    if audio:
        raise InputError(f"--audio is for an audio (Whisper) model, and {original} is a {family.name} model that "
                         f"reads text: leave it out, or give source texts with --input")
    model, tok = family.load_original(Path(original))
    seqs, source, tok_check = marian_inputs(tok, tokenizer, texts, samples, family=family.name)
    report = OriginalReport(str(original), candidate, len(seqs), source, reference=family.original,
                            representative=bool(texts), family=family.name)
    if tok_check is not None:
        report.checks.append(tok_check)
    progress(f"logits: {family.original} vs the imported reference model")
    ours = reference_of(original)
    report.checks.append(logits_check(model, ours, seqs))
    max_new_tokens = min(max_new_tokens, engine.max_len)
    progress(f"tokens: {family.original} generate vs {candidate or 'the engine'} "
             f"(beams {', '.join(map(str, beams))})")
    report.checks += token_checks(model, engine, seqs, beams, max_new_tokens, length_penalty, token_match,
                                  family.name)
    return report
