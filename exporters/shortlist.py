"""`onnxformer shortlist`: a vocabulary shortlist built from the model's own translations, gated, into a bundle.

    out, report = shortlist_bundle(bundle, corpus, out, sizes=(20, 50), always=200, texts=held_out)

1. The bundle translates the corpus (greedy, full vocabulary). Each source token's candidates are the target
   tokens that most often appear in the translations of the lines holding it (co-occurrence counts; no external
   aligner), beyond the always-included set: the specials and the `always` most frequent target tokens.
2. The decoder's shortlist variant is written beside it (exporters/shortlist_graph.py), with the projection table
   its rows are gathered from per request where the bundle does not hold it already (shortlist.weight.bin).
3. The gate, per candidate size from the smallest: greedy tokens with the shortlist against the full vocabulary on
   held-out inputs (toolkit.parity.inputs: --input texts, else the task's, else random ids) must agree on at
   least SHORTLIST_TOKEN_MATCH of the tokens, on reference outputs that vary. The smallest size that passes is
   kept; none passing refuses the bundle with the figures (ParityError), or with allow_unverified writes the
   largest marked unverified.
A multilingual bundle (NLLB, mBART-50: the target language chosen per request) gets one map per target language
(--tgt-lang, several): the corpus translated into each, each map gated on its own, the runtime picking an input's
map by its forced first target token (the language). The map (shortlist.npz), the decoder and the manifest's
"shortlist" record (sizes, agreement, per language) are hashed with every other file of the bundle.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from exporters.bundle import graph_entry, stage_bundle, write_manifest
from exporters.shortlist_graph import WEIGHT_FILE, ShortlistGraphError, write_shortlist_decoder
from runtime.bundle import load_bundle
from runtime.errors import InputError
from runtime.generate import generate_ids
from runtime.manifest import listed_files, read_manifest, sha256_file
from runtime.request import encode_inputs, languages, search_options
from runtime.session import SessionConfig, make_session
from runtime.shortlist import Shortlist, ShortlistWeight
from runtime.spec import source_vocab_size
from toolkit.parity import ParityError
from toolkit.parity.generation import compare_tokens
from toolkit.parity.inputs import DEFAULT_SAMPLES, choose_inputs
from toolkit.parity.report import needed_distinct
from toolkit.parity.tolerances import SHORTLIST_TOKEN_MATCH
from toolkit.reference.config import ModelConfig

MAP_FILE, DECODER_FILE = "shortlist.npz", "decoder.shortlist.onnx"
BATCH = 16                          # inputs per generate call while translating the corpus and the gate's inputs
DEFAULT_SIZES, DEFAULT_ALWAYS = (20, 50, 100), 200


@dataclass
class ShortlistReport:
    """What `onnxformer shortlist` did: the corpus, each size the gate tried, the one kept (a multilingual bundle:
    per target language, `languages`)."""

    corpus_lines: int
    gate_source: str
    tried: list[dict] = field(default_factory=list)
    kept: dict | None = None
    verified: bool = False
    languages: list[dict] = field(default_factory=list)   # per target language: code, lead, kept, verified

    def to_dict(self) -> dict:
        out = {"corpus_lines": self.corpus_lines, "gate_source": self.gate_source, "tried": self.tried,
               "kept": self.kept, "verified": self.verified}
        return out | ({"languages": self.languages} if self.languages else {})

    def format(self) -> str:
        lines = [f"corpus: {self.corpus_lines} lines translated; gate on {self.gate_source}"]
        for t in self.tried:
            lines.append(f"  {t['language'] + ' ' if t.get('language') else ''}size {t['size']}: "
                         f"{t['mean_vocab']:.0f} target tokens an input on average, "
                         f"{t['agreement']:.2%} of tokens equal to the full vocabulary "
                         f"({t['sequences_equal']:.1%} of outputs), {t['verdict']}")
        for lang in self.languages:
            lines.append(f"{lang['code']}: kept size {lang['kept']['size']} "
                         f"({'verified' if lang['verified'] else 'NOT verified'})")
        kept = self.kept
        if not self.languages:
            lines.append(f"kept size {kept['size']} ({'verified' if self.verified else 'NOT verified'})" if kept
                         else "nothing kept")
        return "\n".join(lines)


def translate(engine, seqs: Sequence[Sequence[int]], max_new_tokens: int, shortlist: bool,
              lead: Sequence[int] = ()) -> list[list[int]]:
    """Greedy outputs (end token and the forced `lead`, a target language, dropped) of every input, BATCH at a
    time, with or without the shortlist."""
    out = []
    for start in range(0, len(seqs), BATCH):
        part = seqs[start:start + BATCH]
        prefix = {"prefix_ids": (tuple(lead),) * len(part), "prefix_counted": len(lead)} if lead else {}
        opts = search_options(engine, max_new_tokens, shortlist=shortlist, **prefix)
        out += [h[0].tokens[len(lead):] for h in generate_ids(engine, part, opts)]
    return [t[:-1] if t and t[-1] == engine.eos_id else t for t in out]


def build_map(sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], config: dict, size: int,
              always: int) -> Shortlist:
    """The shortlist of `size` candidates a source token (by co-occurrence in (source, translation) pairs) beyond
    the always-included set (the specials and the `always` most frequent targets)."""
    src_vocab, vocab = source_vocab_size(config), config["vocab_size"]
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in targets] + [np.zeros(0, np.int64)])
    freq = np.bincount(flat, minlength=vocab)
    frequent = np.argsort(-freq, kind="stable")[:always]
    specials = [config[k] for k in ("pad_id", "bos_id", "eos_id", "unk_id") if isinstance(config.get(k), int)]
    kept = np.unique(np.concatenate([frequent[freq[frequent] > 0], np.asarray(specials, dtype=np.int64)]))
    pairs = [np.add.outer(np.unique(s) * vocab, np.setdiff1d(t, kept)).ravel() for s, t in zip(sources, targets)]
    keys, counts = np.unique(np.concatenate(pairs + [np.zeros(0, np.int64)]), return_counts=True)
    src, tgt = keys // vocab, keys % vocab
    order = np.lexsort((tgt, -counts, src))                       # per source token: most counted first, then by id
    src, tgt = src[order], tgt[order]
    starts = np.searchsorted(src, src)                            # each entry's rank within its source token
    take = np.arange(len(src)) - starts < size
    offsets = np.concatenate([[0], np.cumsum(np.bincount(src[take], minlength=src_vocab))])
    return Shortlist(offsets.astype(np.int64), tgt[take].astype(np.int64), kept.astype(np.int64))


def save_map(shortlist: Shortlist, path: Path) -> None:
    """The map file: offsets, candidates, always; per-language maps: `leads` (each language's lead token id) and
    offsets_i, candidates_i, always_i for the i-th."""
    if shortlist.languages is None:
        np.savez(path, offsets=shortlist.offsets, candidates=shortlist.candidates.astype(np.int32),
                 always=shortlist.always.astype(np.int32))
        return
    arrays = {"leads": np.asarray(list(shortlist.languages), dtype=np.int64)}
    for i, m in enumerate(shortlist.languages.values()):
        arrays |= {f"offsets_{i}": m.offsets, f"candidates_{i}": m.candidates.astype(np.int32),
                   f"always_{i}": m.always.astype(np.int32)}
    np.savez(path, **arrays)


def gate_check(engine, seqs: list[list[int]], reference: list[list[int]], max_new_tokens: int, size: int,
               lead: Sequence[int] = ()) -> dict:
    """One size's verdict: greedy tokens with the engine's shortlist against the full vocabulary's."""
    got = translate(engine, seqs, max_new_tokens, shortlist=True, lead=lead)
    seq_eq, tok_eq, first = compare_tokens(reference, got)
    distinct = len({tuple(t) for t in reference})
    varied = distinct >= needed_distinct(len(seqs))
    verdict = "inconclusive" if not varied else "ok" if tok_eq >= SHORTLIST_TOKEN_MATCH else "failed"
    vocab = [len(engine.shortlist.of(s, lead)) for s in seqs]
    return {"size": size, "agreement": tok_eq, "sequences_equal": seq_eq, "threshold": SHORTLIST_TOKEN_MATCH,
            "inputs": len(seqs), "distinct_outputs": distinct, "verdict": verdict,
            "mean_vocab": float(np.mean(vocab)), "sizes": engine.shortlist.sizes(), "first_mismatch": first}


def shortlist_bundle(bundle_dir: str | Path, corpus: list, out_dir: str | Path, sizes: Sequence[int] = DEFAULT_SIZES,
                     always: int = DEFAULT_ALWAYS, texts: list[str] | None = None, samples: int = DEFAULT_SAMPLES,
                     max_new_tokens: int | None = None, allow_unverified: bool = False, force: bool = False,
                     progress: Callable[[str], None] | None = None, src_lang: str | None = None,
                     tgt_langs: Sequence[str] = ()) -> tuple[Path, ShortlistReport]:
    """Build, gate and store a shortlist (module docstring) into a copy of the bundle at out_dir. A multilingual
    bundle (its target language chosen per request) needs `tgt_langs`: one map per target language, each built
    from the corpus translated into that language and gated on its own (`src_lang`: the corpus's language)."""
    say = progress or (lambda message: None)
    bundle_dir = Path(bundle_dir)
    sizes = sorted({int(s) for s in sizes})
    if not sizes or sizes[0] < 1 or always < 0:
        raise InputError(f"--size must be positive candidate counts and --always at least 0, got sizes {sizes} and "
                         f"always {always}")
    manifest = read_manifest(bundle_dir)
    bundle = load_bundle(bundle_dir, provider="cpu", shortlist=False)
    engine, config = bundle.engine, manifest["model"]
    plans = _language_plans(bundle.tokenizer, src_lang, tgt_langs)
    sources = encode_inputs(corpus, plans[0][1])
    if not sources:
        raise InputError("--corpus has no lines; pass source texts (token ids for a bundle without tokenizer), one a "
                         "line")
    lead = plans[0][2]                                                # the default length leaves it room
    steps = search_options(engine, max_new_tokens, **({"prefix_ids": (tuple(lead),)} if lead else {})).max_new_tokens
    chosen = choose_inputs(ModelConfig.from_dict(config), plans[0][1], samples, texts)
    old = manifest.pop("shortlist", None)
    with stage_bundle(out_dir, force) as tmp:
        session, table, weight = _stage_decoder(bundle_dir, manifest, old, tmp)
        report = ShortlistReport(len(sources), chosen.source)
        maps, checks = {}, []
        for code, _, lead in plans:
            where = f" into {code}" if code else ""
            say(f"translating {len(sources)} corpus lines{where}")
            targets = translate(engine, sources, steps, shortlist=False, lead=lead)
            reference = translate(engine, chosen.seqs, steps, shortlist=False, lead=lead)
            kept = _smallest_passing(engine, (session, table), (sources, targets), config, sizes, always,
                                     (chosen.seqs, reference, steps, lead, code), report, say)
            maps[lead[0] if code else None] = kept[0]
            checks.append(kept[1])
            if code:
                report.languages.append({"code": code, "lead": lead[0], "kept": kept[1],
                                         "verified": kept[1]["verdict"] == "ok"})
        worst = min(checks, key=lambda c: (c["verdict"] == "ok", c["agreement"]))
        report.kept, report.verified = worst, all(c["verdict"] == "ok" for c in checks)
        if not report.verified and not allow_unverified:
            raise _refusal(report, out_dir)
        shortlist = maps[None] if None in maps else Shortlist.per_language(maps)
        save_map(shortlist, tmp / MAP_FILE)
        record = _record(tmp, worst, always, report, allow_unverified) | {"weight": weight}
        record["size"], record["sizes"] = max(c["size"] for c in checks), shortlist.sizes()
        if report.languages:
            record["languages"] = [{"code": lang["code"], "lead": lang["lead"], "size": lang["kept"]["size"],
                                    "agreement": lang["kept"]["agreement"], "verdict": lang["kept"]["verdict"]}
                                   for lang in report.languages]
        manifest["shortlist"] = record
        write_manifest(tmp, manifest)
    return Path(out_dir), report


def _stage_decoder(bundle_dir: Path, manifest: dict, old: dict | None, tmp: Path) -> tuple:
    """Copy the bundle's files into the staging folder (less an older shortlist's), write the decoder's shortlist
    variant beside them; (its session, the projection table it gathers rows from, that table's record)."""
    skip = {old["file"], old["decoder"]["file"]} if old else set()
    if old and (old.get("weight") or {}).get("file") == WEIGHT_FILE:   # its own table (not weights.data)
        skip.add(WEIGHT_FILE)
    for name in sorted(listed_files(manifest) - skip):
        shutil.copyfile(bundle_dir / name, tmp / name)
    try:
        decoder, weight = write_shortlist_decoder(tmp / manifest["graphs"]["decoder"]["file"], tmp / DECODER_FILE, tmp)
    except ShortlistGraphError as exc:
        raise InputError(f"{bundle_dir}: {exc}") from None
    table = ShortlistWeight(np.fromfile(tmp / weight["file"], dtype=weight["dtype"], offset=weight["offset"],
                                        count=int(np.prod(weight["shape"]))).reshape(weight["shape"]), weight["feed"])
    return make_session(decoder, "cpu", SessionConfig()), table, weight


def _language_plans(tokenizer, src_lang: str | None, tgt_langs: Sequence[str]) -> list[tuple]:
    """(code, framed tokenizer, lead) per target language (one (None, ...) for a bundle of one target language)."""
    plans = []
    for code in list(dict.fromkeys(tgt_langs)) or [None]:
        framed, lead = languages(tokenizer, src_lang, code)
        if code is not None and len(lead) != 1:
            raise InputError(f"tgt_lang {code!r} starts the target with {len(lead)} tokens; a per-language "
                             f"shortlist needs one language token first")
        plans.append((code, framed, lead))
    return plans


def _smallest_passing(engine, decoder: tuple, corpus: tuple, config: dict, sizes: list[int], always: int,
                      gate: tuple, report: ShortlistReport, say) -> tuple:
    """(shortlist, check) of the smallest size the gate passes, else of the largest; every check in report.tried.
    decoder: (shortlist session, projection table); corpus: (sources, translations); gate: (inputs, reference,
    steps, lead, language code)."""
    seqs, reference, steps, lead, code = gate
    for size in sizes:
        engine.use_shortlist(build_map(*corpus, config, size, always), *decoder)
        check = gate_check(engine, seqs, reference, steps, size, lead) | ({"language": code} if code else {})
        say(f"{code + ' ' if code else ''}size {size}: {check['agreement']:.2%} of tokens equal ({check['verdict']})")
        report.tried.append(check)
        if check["verdict"] == "ok":
            break
    return engine.shortlist, check


def _refusal(report: ShortlistReport, out_dir) -> ParityError:
    return ParityError(f"the shortlist did not pass the gate (>= {SHORTLIST_TOKEN_MATCH:.1%} of tokens equal to the "
                       f"full vocabulary on reference outputs that vary): "
                       + "; ".join(f"{t['language'] + ' ' if t.get('language') else ''}size {t['size']} "
                                   f"{t['agreement']:.2%} ({t['verdict']})" for t in report.tried)
                       + f"; nothing was written to {out_dir} (try larger --size or --always, or pass "
                         f"--allow-unverified to write it marked unverified)", report.to_dict())


def _record(tmp: Path, check: dict, always: int, report: ShortlistReport, allow_unverified: bool) -> dict:
    """The manifest's "shortlist" record: files, sizes and the gate's measured agreement."""
    gate = {k: check[k] for k in ("agreement", "sequences_equal", "threshold", "inputs", "distinct_outputs",
                                  "verdict", "mean_vocab")}
    gate["source"] = report.gate_source
    record = {"file": MAP_FILE, "sha256": sha256_file(tmp / MAP_FILE), "decoder": graph_entry(tmp / DECODER_FILE),
              "size": check["size"], "always": always, "sizes": check["sizes"], "corpus_lines": report.corpus_lines,
              "gate": gate, "tried": [{"size": t["size"], "agreement": t["agreement"], "verdict": t["verdict"]}
                                      for t in report.tried],
              "verified": report.verified}
    if not report.verified and allow_unverified:
        record["allowed_unverified"] = True
    return record


__all__ = ["shortlist_bundle", "build_map", "translate", "ShortlistReport", "MAP_FILE", "DECODER_FILE",
           "DEFAULT_SIZES", "DEFAULT_ALWAYS"]
