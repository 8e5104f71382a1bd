"""Languages of multilingual models (NLLB, mBART-50): the source framed in src_lang, the target language forced first.

The imported tokenizer records the model's codes and how a target starts (tokenizer.json: languages, target_start);
runtime.request.languages turns src_lang / tgt_lang into the framing tokenizer and the forced lead ids, which the
search forces without scoring them and counts in beam lengths, as transformers' forced_bos_token_id does. Proof:
texts in, texts out, ids and beam scores equal to transformers' tokenizer(src_lang=...) + generate(
forced_bos_token_id=...) on the tiny NLLB and mBART-50 models, for two target languages whose outputs differ.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from runtime.errors import InputError  # noqa: E402
from runtime.generate import generate, to_outputs  # noqa: E402
from runtime.request import Request, languages, search_options, target_options  # noqa: E402
from toolkit.reference.checkpoint import load_checkpoint  # noqa: E402
from toolkit.reference.torch_engine import TorchEngine  # noqa: E402

TEXTS = ["the quick fox jumps", "a lazy dog", "seven wizards hex the box", "over the jolly fox", "quietly",
         "the box", "brown dog jumps", "wizards"]
PAIRS = {"nllb": ("fra_Latn", ("deu_Latn", "spa_Latn")), "mbart50": ("de_DE", ("en_XX", "fr_XX"))}
MAX_NEW = 8          # transformers' max_new_tokens: the forced language token is one of them


def theirs_generate(model, tokenizer, texts, src, tgt, beam):
    """transformers: (ids after the decoder start, sequences_scores or None, texts)."""
    import torch

    tokenizer.src_lang = src
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, forced_bos_token_id=tokenizer.convert_tokens_to_ids(tgt), num_beams=beam,
                             max_new_tokens=MAX_NEW, do_sample=False, early_stopping="never", forced_eos_token_id=None,
                             output_scores=True, return_dict_in_generate=True)
    eos = model.config.eos_token_id
    rows = [r[: r.index(eos) + 1] if eos in r else r for r in out.sequences[:, 1:].tolist()]
    scores = out.sequences_scores.tolist() if beam > 1 else None
    return rows, scores, tokenizer.batch_decode(out.sequences, skip_special_tokens=True)


def ours_generate(engine, tokenizer, texts, src, tgt, beam, **targets):
    framed, lead = languages(tokenizer, src, tgt)
    options = target_options(framed, len(texts), lead=lead, **targets)
    request = Request.build(engine, texts, framed, search_options(engine, max_new_tokens=MAX_NEW - 1, beam=beam,
                                                                  **options))
    hyps = generate(engine, request)
    return [h[0] for h in hyps], [o.text for o in to_outputs(hyps, engine.eos_id, tokenizer)]


@pytest.fixture(scope="module", params=sorted(PAIRS))
def model(request, multilingual):
    directory, original, theirs, checkpoint = multilingual(request.param)
    ckpt = load_checkpoint(checkpoint)
    return request.param, original, theirs, TorchEngine(ckpt.model), ckpt.tokenizer


@pytest.mark.parametrize("beam", [1, 4])
def test_texts_ids_and_scores_equal_transformers_forced_bos(model, beam):
    name, original, theirs, engine, tokenizer = model
    src, targets = PAIRS[name]
    texts_by_target = {}
    for tgt in targets:
        want_ids, want_scores, want_texts = theirs_generate(original, theirs, TEXTS, src, tgt, beam)
        hyps, texts = ours_generate(engine, tokenizer, TEXTS, src, tgt, beam)
        assert len({tuple(w) for w in want_ids}) >= 5, want_ids               # outputs that vary with the input
        lang = theirs.convert_tokens_to_ids(tgt)
        assert all(w[0] == lang for w in want_ids)
        assert not any(original.config.pad_token_id in w for w in want_ids)   # M2M100 positions a pad its own way
        assert [h.tokens for h in hyps] == want_ids
        assert texts == want_texts
        if want_scores is not None:                                            # the language token is not scored
            assert [h.score for h in hyps] == pytest.approx(want_scores, abs=1e-4)
        texts_by_target[tgt] = texts
    assert texts_by_target[targets[0]] != texts_by_target[targets[1]]         # the target language matters


def test_the_source_is_framed_in_src_lang(model):
    name, _, theirs, _, tokenizer = model
    src, (tgt, _) = PAIRS[name]
    for code in (src, tgt):
        theirs.src_lang = code
        framed, _ = languages(tokenizer, code, tgt)
        assert [framed.encode(t) for t in TEXTS] == [theirs(t)["input_ids"] for t in TEXTS]
    assert languages(tokenizer, None, tgt)[0] is tokenizer


def test_a_prefix_follows_the_language_token(model):
    name, _, theirs, engine, tokenizer = model
    src, (tgt, _) = PAIRS[name]
    hyps, _ = ours_generate(engine, tokenizer, TEXTS[:3], src, tgt, 1, prefix="the")
    lang, start = theirs.convert_tokens_to_ids(tgt), tokenizer.encode_target("the")
    assert all(h.tokens[:1 + len(start)] == [lang, *start] for h in hyps)


def test_language_mistakes_are_refused_by_name(model):
    name, _, _, _, tokenizer = model
    src, (tgt, _) = PAIRS[name]
    n = len(tokenizer.languages)
    with pytest.raises(InputError, match=rf"multilingual: give the target language.*e\.g\. .*\({n} codes: "
                                         r"onnxformer inspect BUNDLE lists them\)"):
        languages(tokenizer, src, None)
    with pytest.raises(InputError, match=rf"unknown tgt_lang '{tgt.split('_')[0]}'; did you mean {tgt}"):
        languages(tokenizer, src, tgt.split("_")[0])
    with pytest.raises(InputError, match="unknown src_lang 'xx_Nope'"):
        languages(tokenizer, "xx_Nope", tgt)


def test_languages_are_recorded_at_import(multilingual):
    from runtime.tokenizer import load_tokenizer

    checkpoint = multilingual("nllb")[3]
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    assert spec["target_start"] == ["{tgt_lang}"] and spec["source_prefix"] == ["{src_lang}"]
    assert len(spec["languages"]) == 202 and {"deu_Latn", "eng_Latn", "zho_Hant"} <= set(spec["languages"])
    assert load_tokenizer(checkpoint / "tokenizer.json").languages == tuple(spec["languages"])


def test_a_model_without_languages_refuses_them(toy_exported):
    from runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(toy_exported[1] / "tokenizer.json")
    assert languages(tokenizer) == (tokenizer, [])
    with pytest.raises(InputError, match="has no languages to choose .*drop tgt_lang"):
        languages(tokenizer, None, "deu_Latn")


def test_the_bundle_records_its_languages(nllb_bundle, multilingual):
    from runtime.bundle import load_bundle
    from runtime.manifest import read_manifest, verify_hashes

    manifest = read_manifest(nllb_bundle)
    verify_hashes(nllb_bundle, manifest)                           # tokenizer.json, languages and all, hashed
    codes = json.loads((nllb_bundle / "tokenizer.json").read_text())["languages"]
    assert manifest["languages"] == {"source": codes, "target": codes}
    assert "tokenizer.json" in manifest["files"]
    bundle = load_bundle(nllb_bundle, "cpu")
    _, original, theirs, _ = multilingual("nllb")
    _, _, want = theirs_generate(original, theirs, TEXTS, "fra_Latn", "deu_Latn", 1)
    assert ours_generate(bundle.engine, bundle.tokenizer, TEXTS, "fra_Latn", "deu_Latn", 1)[1] == want


def cli(*args):
    from click.testing import CliRunner

    from toolkit.apps.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_generate_command_languages(multilingual):
    _, original, theirs, checkpoint = multilingual("nllb")
    _, _, want = theirs_generate(original, theirs, TEXTS[:3], "fra_Latn", "spa_Latn", 1)
    ok = cli("generate", checkpoint, *TEXTS[:3], "--src-lang", "fra_Latn", "--tgt-lang", "spa_Latn",
             "--max-new-tokens", MAX_NEW - 1)
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.splitlines() == want
    for args, message in ((["--src-lang", "fra_Latn"], "this model is multilingual: give the target language, "
                           "tgt_lang (--tgt-lang), e.g. deu_Latn, eng_Latn, fra_Latn (202 codes: onnxformer inspect "
                           "BUNDLE lists them)"),
                          (["--tgt-lang", "deu"], "unknown tgt_lang 'deu'; did you mean deu_Latn?"),
                          (["--tgt-lang", "deu_Latn", "--src-lang", "french"], "unknown src_lang 'french'")):
        refused = cli("generate", checkpoint, "the box", *args)
        assert refused.exit_code == 2 and message in refused.output, refused.output
        assert "Traceback" not in refused.output


def test_score_does_not_score_the_target_language(multilingual, tmp_path):
    import torch

    from runtime.score import score_texts

    _, original, theirs, checkpoint = multilingual("nllb")
    ckpt = load_checkpoint(checkpoint)
    got = score_texts(TorchEngine(ckpt.model), ckpt.tokenizer, TEXTS[:2], TEXTS[2:4], "fra_Latn", "deu_Latn")
    theirs.src_lang, theirs.tgt_lang = "fra_Latn", "deu_Latn"
    batch = theirs(TEXTS[:2], text_target=TEXTS[2:4], return_tensors="pt", padding=True)
    labels = batch["labels"]                                   # [deu_Latn] tokens </s>, padded
    with torch.no_grad():
        logp = original(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        labels=labels).logits.log_softmax(-1)
    for row, record in enumerate(got):
        ids = [t for t in labels[row].tolist() if t != theirs.pad_token_id]
        assert [ids[0], *record["ids"]] == ids
        want = logp[row, 1:len(ids)].gather(-1, labels[row, 1:len(ids), None]).sum()
        assert record["score"] == pytest.approx(float(want), abs=1e-4)
    (tmp_path / "src.txt").write_text("\n".join(TEXTS[:2]) + "\n")
    (tmp_path / "tgt.txt").write_text("\n".join(TEXTS[2:4]) + "\n")
    files = ("--source", tmp_path / "src.txt", "--target", tmp_path / "tgt.txt")
    scored = cli("score", checkpoint, *files, "--src-lang", "fra_Latn", "--tgt-lang", "deu_Latn")
    assert scored.exit_code == 0 and [float(x) for x in scored.stdout.split()] == \
        pytest.approx([r["score"] for r in got], abs=1e-5)
    refused = cli("score", checkpoint, *files)
    assert refused.exit_code == 2 and "give the target language" in refused.output, refused.output


def test_inspect_lists_the_languages(nllb_bundle):
    listed = cli("inspect", nllb_bundle)
    assert listed.exit_code == 0, listed.output
    line = next(x for x in listed.output.splitlines() if x.startswith("target languages"))
    assert line.startswith("target languages (202): ace_Arab ace_Latn") and "deu_Latn" in line.split()


def test_requests_with_one_target_language_batch_together(model):
    """Inputs that share their forced prefix (the target language) merge into one search and get what they get
    alone; another target language keeps its own batch."""
    from runtime.request import merge

    name, _, _, engine, tokenizer = model
    src, (tgt, other) = PAIRS[name]

    def build(texts, target):
        framed, lead = languages(tokenizer, src, target)
        opts = search_options(engine, max_new_tokens=MAX_NEW - 1, **target_options(framed, len(texts), lead=lead))
        return Request.build(engine, texts, framed, opts)

    a, b, c = build(TEXTS[:2], tgt), build(TEXTS[2:5], tgt), build(TEXTS[:1], other)
    assert a.batch_key == b.batch_key != c.batch_key
    together = generate(engine, merge([a, b]))
    assert [h[0].tokens for h in together] == [h[0].tokens for r in (a, b) for h in generate(engine, r)]


def test_the_python_api_takes_the_languages(nllb_bundle, multilingual):
    from runtime import Translator

    _, original, theirs, _ = multilingual("nllb")
    translator = Translator(nllb_bundle, provider="cpu")
    for beam in (1, 4):
        _, _, want = theirs_generate(original, theirs, TEXTS, "fra_Latn", "deu_Latn", beam)
        got = translator.generate(TEXTS, src_lang="fra_Latn", tgt_lang="deu_Latn", beam=beam, max_new_tokens=MAX_NEW - 1)
        assert [r.text for r in got] == want
    pieces = translator.stream(TEXTS[0], src_lang="fra_Latn", tgt_lang="deu_Latn", max_new_tokens=MAX_NEW - 1)
    _, _, want = theirs_generate(original, theirs, TEXTS[:1], "fra_Latn", "deu_Latn", 1)
    assert "".join(pieces) == want[0]
    with pytest.raises(InputError, match="this model is multilingual: give the target language"):
        translator.generate(TEXTS[:1])
    with pytest.raises(InputError, match="unknown option 'prefix_counted'"):
        translator.generate(TEXTS[:1], tgt_lang="deu_Latn", prefix_counted=1)


def test_the_server_scores_and_streams_in_the_target_language(nllb_bundle):
    from fastapi.testclient import TestClient

    from runtime.score import score_texts
    from toolkit.apps.serve.app import ServeSettings, Service, create_app

    service = Service.load(nllb_bundle, ServeSettings(provider="cpu", max_batch=4))
    targets = ["the box", "a lazy dog"]
    want = score_texts(service.engine, service.tokenizer, TEXTS[:2], targets, "fra_Latn", "deu_Latn")
    other = score_texts(service.engine, service.tokenizer, TEXTS[:2], targets, "fra_Latn", "spa_Latn")
    assert [r["score"] for r in want] != [r["score"] for r in other], "the target language changes nothing"
    with TestClient(create_app(service, start_in_background=False)) as client:
        got = client.post("/v1/score", json={"source": TEXTS[:2], "target": targets, "src_lang": "fra_Latn",
                                             "tgt_lang": "deu_Latn"})
        assert got.status_code == 200, got.text
        assert got.json()["scores"] == want
        missing = client.post("/v1/score", json={"source": TEXTS[:1], "target": targets[:1]})
        assert missing.status_code == 422 and "this model is multilingual" in missing.text
        body = {"inputs": TEXTS[:2], "src_lang": "fra_Latn", "tgt_lang": "deu_Latn", "max_new_tokens": MAX_NEW - 1}
        plain = client.post("/v1/generate", json=body).json()["outputs"]
        with client.stream("POST", "/v1/generate", json={**body, "stream": True}) as streamed:
            events = [json.loads(line[5:]) for line in streamed.iter_lines() if line.startswith("data:")]
        assert events[-1]["final"] and events[-1]["outputs"] == plain
