"""The translation service (toolkit/apps/serve: models, translate, compat, keys): several bundles in one
server, long texts split into sentences and pieces that fit (toolkit.apps.segment, also `onnxformer generate`'s), the
LibreTranslate and DeepL APIs proven with their own client libraries, API keys, rates and quotas, HTTPS.

Servers listen on 127.0.0.1 with a free port; every request is bounded in time. Reference translations come from
runtime.generate on each sentence alone (the dates model: its outputs vary with the input).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from runtime.generate import generate_ids, to_outputs  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from runtime.tokenizer import CharTokenizer  # noqa: E402
from toolkit.apps.serve.app import ServeSettings, bind, create_app  # noqa: E402
from toolkit.apps.serve.keys import ApiKeys, Denied, KeysError, check_access  # noqa: E402
from toolkit.apps.serve.models import ModelError, ModelSet, manifest_languages, parse_languages, parse_specs  # noqa
from toolkit.apps.segment import plan_texts, sentences  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATES_CHARS = "0123456789 ,./-abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
TEXT = "Monday, 30 November 2026. Nov 3rd 1999.  11/30/26"
LONG = "Monday, 30 November 2026 and Nov 3rd 1999 and 11/30/26 and also 1/5/2026"    # over max_len 48, no period
SETTINGS = ServeSettings(provider="cpu", max_batch=8, max_wait_ms=2)
LANGS = {"dates": (("en",), ("de",))}


# --- long texts: sentences, pieces, joins ---

def test_plan_keeps_whitespace_and_covers_every_character():
    tok = CharTokenizer(DATES_CHARS)
    texts = ["  Monday, 30 November 2026.  Then 11/30/26 came.\n\nok ", "short", "aaaa " + "b" * 23 + " cc dd ee"]
    plan = plan_texts(texts, tok, max_len=10, lang="en")
    assert plan.join([tok.decode(r) for r in plan.rows]) == texts          # identity translation: the text back
    assert all(1 <= len(r) <= 10 for r in plan.rows)
    long_word = [tok.decode(r) for r in plan.rows if set(tok.decode(r)) == {"b"}]
    assert long_word == ["b" * 10, "b" * 10, "bbb"]                          # cut at token boundaries, none lost
    assert plan.join(["<%d>" % i for i in range(len(plan.rows))])[1] == "<7>"   # one row per short text
    assert plan_texts(["   "], tok, 10).join([]) == ["   "]                  # whitespace only: nothing to decode


def test_sentences_follow_the_language_rules_and_lose_nothing():
    text = "Dr. Smith came at 5 p.m. today. He left!  Then?"
    parts = sentences(text, "en")
    assert "".join(parts) == text and len(parts) == 3, parts
    assert sentences("Am 3. Oktober kam er. Dann ging er.", "de") == ["Am 3. Oktober kam er. ", "Dann ging er."]
    german = "Ich wohne in der Str. 5. Das ist gut."                 # English rules end a sentence at "Str."
    for code in ("de", "DE", "de-AT", "deu_Latn", "de_DE"):         # client codes and the models' own
        assert sentences(german, code) == ["Ich wohne in der Str. 5. ", "Das ist gut."], code
    assert len(sentences(german, None)) == len(sentences(german, "eng_Latn")) == 3


def test_generate_splits_by_the_source_language_rules(nllb_bundle):
    """generate --src-lang: a multilingual model's source language chooses the sentence rules."""
    from runtime.bundle import load_bundle
    from toolkit.apps.commands.generate import build_request

    bundle = load_bundle(nllb_bundle, provider="cpu")
    german = "Ich wohne in der Str. 5. Das ist gut."
    rows = {src: len(build_request(bundle.engine, bundle.tokenizer, [german], True, {}, (None,) * 5,
                                   (src, "fra_Latn"))[0].sequences) for src in ("deu_Latn", "eng_Latn")}
    assert rows == {"deu_Latn": 2, "eng_Latn": 3}


def test_splitting_without_sentencex_names_the_fix(monkeypatch):
    import sys

    from runtime.errors import InputError

    monkeypatch.setitem(sys.modules, "sentencex", None)                   # as if it were not installed
    with pytest.raises(InputError, match="pip install sentencex .*--no-split"):
        sentences("One. Two.", "en")


# --- names, languages, keys ---

def test_model_specs_and_languages(tmp_path):
    assert parse_specs([str(tmp_path / "de-en")]) == {"de-en": tmp_path / "de-en"}
    assert parse_specs(["a=x", "b=y"]) == {"a": Path("x"), "b": Path("y")}
    for specs, message in ((["x", "y"], "name each one"), (["a=x", "a=y"], "given twice"), (["a b=x"], "letters")):
        with pytest.raises(ModelError, match=message):
            parse_specs(specs)
    assert parse_languages(["a=de,fr:EN-us"], ["a"]) == {"a": (("de", "fr"), ("en-us",))}
    for spec, message in (("b=de:en", "one of the served"), ("a=de", "NAME=SRC:TGT"), ("a=d!:en", "not a language")):
        with pytest.raises(ModelError, match=message):
            parse_languages([spec], ["a"])
    assert manifest_languages({"languages": {"source": ["DE"], "target": ["en"]}}, "b") == (("de",), ("en",))
    assert manifest_languages({}, "b") == ((), ())
    with pytest.raises(ModelError, match="'languages' must be"):
        manifest_languages({"languages": ["de", "en"]}, "b")


def write_keys(path, text: str) -> ApiKeys:
    path.write_text(text)
    return ApiKeys.load(path)


def test_keys_file_rates_and_quotas(tmp_path):
    keys = write_keys(tmp_path / "keys", "# clients\nalpha rpm=2\n\nbeta chars=10  # small\ngamma\n")
    assert keys.admit("alpha").label == "key 2" and keys.admit("alpha").requests == 2
    with pytest.raises(Denied) as denied:
        keys.admit("alpha")
    assert denied.value.kind == "rate" and 1 <= denied.value.retry_after <= 60
    assert keys.admit("beta", 6).used_chars == 6
    with pytest.raises(Denied, match="would pass its 10 characters") as denied:
        keys.admit("beta", 5)
    assert denied.value.kind == "quota" and keys.find("beta").used_chars == 6     # a refused request costs nothing
    for presented, kind in ((None, "missing_key"), ("", "missing_key"), ("alph", "invalid_key"),
                            ("alpha2", "invalid_key")):
        with pytest.raises(Denied) as denied:
            keys.admit(presented)
        assert denied.value.kind == kind and "alpha" not in str(denied.value)
    for text, message in (("", "holds no key"), ("a\na\n", "twice"), ("a rpm=0\n", "not a limit"),
                          ("a x=1", "not a limit")):
        with pytest.raises(KeysError, match=message):
            write_keys(tmp_path / "bad", text)
    assert ApiKeys([]).admit(None, 5).used_chars == 5                           # an open server counts everything


def test_open_servers_listen_on_loopback_only(tmp_path):
    with pytest.raises(KeysError, match="--allow-open"):
        check_access("0.0.0.0", None, False, False, None, None)
    assert check_access("0.0.0.0", None, False, True, None, None) == (None, None)
    assert check_access("localhost", None, False, False, None, None) == (None, None)
    with pytest.raises(KeysError, match="needs --api-keys"):
        check_access("127.0.0.1", None, True, False, None, None)
    with pytest.raises(KeysError, match="both --ssl-certfile and --ssl-keyfile"):
        check_access("127.0.0.1", None, False, False, tmp_path / "cert.pem", None)
    from toolkit.apps.cli import main

    result = CliRunner().invoke(main, ["serve", str(tmp_path), "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 2 and "--allow-open" in result.stderr and "Traceback" not in result.output


# --- servers ---

@pytest.fixture(scope="module")
def reference(dates_bundle):
    """texts -> the dates model's translation of each row alone, joined as the server joins them."""
    from runtime.bundle import load_bundle

    bundle = load_bundle(dates_bundle, provider="cpu")
    engine, tok = bundle.engine, bundle.tokenizer

    def translate(texts: list[str]) -> list[str]:
        plan = plan_texts(texts, tok, engine.max_len, "en")
        rows = [to_outputs(generate_ids(engine, [row], SearchOptions(max_new_tokens=engine.max_len)),
                           engine.eos_id, tok)[0].text for row in plan.rows]
        return plan.join(rows)

    return translate


def generate_cli(bundle, *args: str):
    from toolkit.apps.cli import main

    result = CliRunner().invoke(main, ["generate", str(bundle), "--provider", "cpu", "--max-new-tokens", "48", *args])
    assert "Traceback" not in result.output, result.output
    return result


def test_generate_splits_texts_as_the_service_does(dates_bundle, reference, tmp_path):
    """`onnxformer generate` splits TEXT arguments and --input lines like the compatible APIs: one line per input,
    the sentences' outputs joined with its whitespace; --no-split keeps each text one row (an over-long one refused)."""
    lines = tmp_path / "in.txt"
    lines.write_text(f"{TEXT}\n{LONG}\n11/30/26\n")
    result = generate_cli(dates_bundle, "Nov 3rd 1999.  ", "--input", str(lines))
    expected = reference(["Nov 3rd 1999.  ", TEXT, LONG, "11/30/26"])
    assert result.exit_code == 0 and result.stdout.splitlines() == expected
    whole = generate_cli(dates_bundle, "--no-split", "--input", str(lines))        # TEXT: 49 characters, max_len 48
    assert whole.exit_code == 2 and "input 0 has 49 tokens" in whole.stderr and "maximum source length" in whole.stderr


def test_generate_an_input_past_the_limit_is_cut_and_said_or_refused_with_the_way_out(dates_bundle, reference,
                                                                                      tmp_path):
    """One input of 2,000+ characters (40x the dates model's 48 tokens), in one sentence and as one word: split
    (the default), every piece fits and stderr says it was cut, nothing truncated (the output is the pieces'
    translations joined); --no-split: exit 2, one line naming the limit, the input's length and the flags."""
    long = " and ".join([LONG] * 28)                                       # one sentence of 2,184 characters
    word = "1" * 2100
    for text in (long, word):
        file = tmp_path / "in.txt"
        file.write_text(text + "\n")
        for args in ((text,), ("--input", str(file)), ("--input", "-")):
            result = CliRunner().invoke(__import__("toolkit.apps.cli", fromlist=["main"]).main,
                                        ["generate", str(dates_bundle), "--provider", "cpu", *args],
                                        input=text + "\n" if args[-1] == "-" else None)
            assert result.exit_code == 0 and "Traceback" not in result.output, result.output
            assert result.stdout.splitlines() == reference([text]), args
            note = [line for line in result.stderr.splitlines() if line.startswith("note: input 0")]
            assert len(note) == 1 and "longer than the model's maximum source length 48" in note[0], result.stderr
            assert f"({len(text)} tokens)" in note[0] and "--no-split refuses" in note[0]
        refused = generate_cli(dates_bundle, "--no-split", "--input", str(file))
        assert refused.exit_code == 2 and refused.stdout == ""
        assert refused.stderr.strip() == (f"error: input 0 has {len(text)} tokens, more than the model's maximum "
                                          f"source length 48; drop --no-split to translate it in sentences and "
                                          f"pieces that fit, or shorten it")


def test_generate_json_records_join_the_sentences(dates_bundle):
    """A split text's record: the sentences' records of the same call joined (text with its whitespace, ids and
    logprobs concatenated, scores summed); token ids stay one row; a prefix forces the first sentence only."""
    import json

    parts = ["Monday, 30 November 2026.", "Nov 3rd 1999.", "1/5/2026"]
    text = "{} {}  {}".format(*parts)
    result = generate_cli(dates_bundle, text, *parts, "--ids", "4 16 8 16 5 3 5 9", "--json", "--return-logprobs")
    recs = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.exit_code == 0 and [r["index"] for r in recs] == [0, 1, 2, 3, 4] and recs[0]["input"] == text
    alone = recs[1:4]
    assert len({r["text"] for r in alone}) == 3                           # outputs that vary with the input
    assert recs[0]["text"] == "{} {}  {}".format(*(r["text"] for r in alone))
    assert recs[0]["ids"] == [t for r in alone for t in r["ids"]] and recs[0]["finished"]
    assert recs[0]["logprobs"] == [x for r in alone for x in r["logprobs"]]
    assert recs[0]["score"] == pytest.approx(sum(r["score"] for r in alone), abs=1e-5)
    assert recs[4]["input"] == [4, 16, 8, 16, 5, 3, 5, 9] and recs[4]["text"] == alone[2]["text"]     # "1/5/2026"
    forced = generate_cli(dates_bundle, text, "--prefix", "19", "--max-new-tokens", "40")    # prefix + new <= 48
    first, *rest = forced.stdout.rstrip("\n").split(" ")
    assert forced.exit_code == 0 and first.startswith("19") and rest == recs[0]["text"].split(" ")[1:]


@contextmanager
def serving(app, ssl: tuple | None = None):
    """`app` on a uvicorn server in a thread, on 127.0.0.1 and a free port; yields its base URL once ready."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    certfile, keyfile = ssl or (None, None)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", ssl_certfile=certfile,
                                           ssl_keyfile=keyfile))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"{'https' if ssl else 'http'}://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=5, verify=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"server at {url} did not become ready"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def open_url(dates_bundle, toy_exported):
    models = ModelSet.load({"dates": dates_bundle, "toy": toy_exported[1]}, SETTINGS, LANGS)
    with serving(create_app(models)) as url:
        yield url


def test_several_models_in_one_server(open_url, reference):
    listed = httpx.get(open_url + "/v1/models", timeout=30).json()["models"]
    assert [m["name"] for m in listed] == ["dates", "toy"]
    assert listed[0]["languages"] == {"source": ["en"], "target": ["de"]} and listed[1]["languages"]["target"] == []
    assert all(m["precision"] == "fp32" and m["bytes"] > 0 and m["state"] == "ready" for m in listed)
    texts = ["Monday, 30 November 2026", "11/30/26"]
    answer = httpx.post(open_url + "/v1/generate", json={"model": "dates", "inputs": texts, "max_new_tokens": 48},
                        timeout=60)
    assert [r["text"] for r in answer.json()["outputs"]] == reference(texts)
    toy = httpx.post(open_url + "/v1/generate", json={"model": "toy", "ids": [[5, 6, 7, 8]]}, timeout=60)
    assert toy.status_code == 200 and toy.json()["outputs"][0]["ids"]
    for body, message in (({"inputs": texts}, "name one in \"model\": dates, toy"),
                          ({"model": "nope", "inputs": texts}, "unknown model 'nope'")):
        refused = httpx.post(open_url + "/v1/generate", json=body, timeout=30)
        assert refused.status_code == 422 and message in refused.json()["error"], refused.text
    assert httpx.get(open_url + "/v1/model?name=toy", timeout=30).json()["tokenizer"] is True
    metrics = httpx.get(open_url + "/metrics", timeout=30).text
    assert 'onnxformer_requests_total{model="dates",outcome="ok"}' in metrics


def test_libretranslate_client(open_url, reference):
    from urllib.error import HTTPError

    from libretranslatepy import LibreTranslateAPI

    lt = LibreTranslateAPI(open_url)
    assert lt.translate(TEXT, "en", "de", timeout=60) == reference([TEXT])[0]
    assert lt.translate(LONG, "auto", "de", timeout=60) == reference([LONG])[0]
    listed = lt.languages(timeout=30)
    assert listed == [{"code": "en", "name": "English", "targets": ["de"]}]     # LibreTranslate's names
    for entry in listed:                          # a client that lists the languages first, then translates each pair
        for target in entry["targets"]:
            assert lt.translate(TEXT, entry["code"], target, timeout=60) == reference([TEXT])[0]
    batch = httpx.post(open_url + "/translate", json={"q": [TEXT, "Nov 3rd 1999"], "source": "en", "target": "de"},
                       timeout=60)
    assert batch.json() == {"translatedText": reference([TEXT, "Nov 3rd 1999"])}
    for source, target, status in (("en", "fr", 400), ("fr", "de", 400)):
        with pytest.raises(HTTPError) as refused:
            lt.translate("Nov 3rd 1999", source, target, timeout=30)
        assert refused.value.code == status
    bad = httpx.post(open_url + "/translate", data={"q": "caf\u00e9!", "source": "en", "target": "de"}, timeout=30)
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]


def test_deepl_client(open_url, reference):
    import deepl

    translator = deepl.Translator("any-key", server_url=open_url)
    one = translator.translate_text(TEXT, target_lang="DE", source_lang="EN")
    assert one.text == reference([TEXT])[0] and one.detected_source_lang == "EN" and one.billed_characters == len(TEXT)
    many = translator.translate_text([TEXT, LONG], target_lang="DE")
    assert [r.text for r in many] == reference([TEXT, LONG])
    form = httpx.post(open_url + "/v2/translate", data={"text": [TEXT, "1/5/2026"], "target_lang": "de"},
                      headers={"Authorization": "DeepL-Auth-Key any-key"}, timeout=60)      # text repeated in a form
    assert [t["text"] for t in form.json()["translations"]] == reference([TEXT, "1/5/2026"])
    assert [(lang.code, lang.name) for lang in translator.get_source_languages()] == [("EN", "EN")]
    assert [lang.code for lang in translator.get_target_languages()] == ["DE"]
    used = translator.get_usage().character.count
    assert used >= 2 * len(TEXT) + len(LONG)
    with pytest.raises(deepl.DeepLException, match="no served model translates"):
        translator.translate_text(TEXT, target_lang="FR")
    with pytest.raises(deepl.DeepLException, match="outside the vocabulary"):
        translator.translate_text("caf\u00e9 au lait", target_lang="DE")        # admitted, then refused: refunded
    assert translator.get_usage().character.count == used                     # refused requests cost nothing


@pytest.fixture(scope="module")
def keyed_url(dates_bundle, tmp_path_factory):
    """The dates model behind API keys and HTTPS: (url, certificate file)."""
    root = tmp_path_factory.mktemp("keyed")
    (root / "keys").write_text("good-key\nsmall-key chars=30\nslow-key rpm=1\n")
    cert, key = self_signed(root)
    models = ModelSet.load({"dates": dates_bundle}, SETTINGS, LANGS)
    with serving(create_app(models, keys=ApiKeys.load(root / "keys", protect_metrics=True)), ssl=(cert, key)) as url:
        yield url, cert


def self_signed(root):
    """A certificate for 127.0.0.1 and its key, made here (with cryptography where installed, else openssl)."""
    import datetime
    import ipaddress
    import subprocess

    try:
        from cryptography import x509
    except ImportError:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(root / "key.pem"), "-out", str(root / "cert.pem"), "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True, timeout=60)
        return str(root / "cert.pem"), str(root / "key.pem")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    (root / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (root / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return str(root / "cert.pem"), str(root / "key.pem")


def test_keys_guard_every_api_over_https(keyed_url, reference):
    import deepl

    url, cert = keyed_url
    with httpx.Client(verify=cert, timeout=60) as client:
        assert client.get(url + "/healthz").status_code == 200                       # open, and HTTPS verified
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401)):
            refused = client.post(url + "/v1/generate", json={"inputs": ["11/30/26"]}, headers=headers)
            assert refused.status_code == status and "API key" in refused.json()["error"]
        assert client.get(url + "/metrics").status_code == 401
        good = {"Authorization": "Bearer good-key"}
        assert client.post(url + "/v1/generate", json={"inputs": ["11/30/26"]}, headers=good).status_code == 200
        metrics = client.get(url + "/metrics", headers=good).text
        assert "invalid_key" in metrics and "good-key" not in metrics
        libre = client.post(url + "/translate", data={"q": TEXT, "source": "en", "target": "de", "api_key": "good-key"})
        assert libre.json() == {"translatedText": reference([TEXT])[0]}
        refused = client.post(url + "/translate", data={"q": TEXT, "source": "en", "target": "de"})
        assert refused.status_code == 401 and "error" in refused.json()
        over = client.post(url + "/translate", json={"q": TEXT, "source": "en", "target": "de", "api_key": "small-key"})
        assert over.status_code == 403 and "30 characters this month" in over.json()["error"]   # key over its scope
        assert client.post(url + "/v1/generate", json={"inputs": ["1/5/2026"]},
                           headers={"Authorization": "Bearer slow-key"}).status_code == 200
        limited = client.post(url + "/v1/generate", json={"inputs": ["1/5/2026"]},
                              headers={"Authorization": "Bearer slow-key"})
        assert limited.status_code == 429 and 1 <= int(limited.headers["Retry-After"]) <= 60
    for key, error in (("wrong", deepl.AuthorizationException), ("small-key", deepl.QuotaExceededException)):
        translator = deepl.Translator(key, server_url=url, verify_ssl=cert)
        if key == "small-key":
            assert translator.translate_text("Nov 3rd 1999", target_lang="DE").text == reference(["Nov 3rd 1999"])[0]
            assert translator.get_usage().character.count == len("Nov 3rd 1999")
            assert translator.get_usage().character.limit == 30
        with pytest.raises(error):
            translator.translate_text(TEXT, target_lang="DE")


def test_serve_command_with_several_bundles_keys_and_https(dates_bundle, toy_exported, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    cert, key = self_signed(tmp_path)
    (tmp_path / "keys").write_text("cli-key\n")
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.apps.cli", "serve", f"dates={dates_bundle}",
                             f"toy={toy_exported[1]}", "--languages", "dates=en:de", "--port", "0", "--provider",
                             "cpu", "--api-keys", str(tmp_path / "keys"), "--ssl-certfile", cert, "--ssl-keyfile", key],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None:
            line = proc.stderr.readline()
            assert (line or proc.poll() is None) and time.monotonic() < deadline, "server did not become ready"
            url = line.split()[1] if line.startswith("ready: ") else None
        assert url.startswith("https://127.0.0.1:")
        with httpx.Client(verify=cert, timeout=60) as client:
            models = client.get(url + "/v1/models", headers={"Authorization": "Bearer cli-key"}).json()["models"]
            assert [(m["name"], m["languages"]["target"]) for m in models] == [("dates", ["de"]), ("toy", [])]
            assert client.get(url + "/v1/models").status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        tail = proc.stderr.read()
        assert "stopped: 0 requests answered" in tail and "cli-key" not in tail and "Traceback" not in tail, tail
    finally:
        if proc.poll() is None:
            proc.kill()


def test_service_modules_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; import toolkit.apps.serve.compat, toolkit.apps.serve.translate, toolkit.apps.serve.keys, "
            "toolkit.apps.segment, toolkit.apps.serve.models; "
            "assert 'torch' not in sys.modules and 'onnx' not in sys.modules, 'torch or onnx imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_translation_client_that_leaves_frees_its_rows(dates_bundle):
    import json
    import socket

    from test_serve import Gated, label_metric, metric

    models = ModelSet.load({"dates": dates_bundle}, ServeSettings(provider="cpu", max_batch=1, max_wait_ms=0), LANGS)
    service = models.services[0]
    gated = Gated(service.engine)
    service.scheduler.engine = gated
    gated.gate.set()                                                    # warm-up runs ungated
    with serving(create_app(models)) as url:
        gated.gate.clear()
        gated.started_rows.clear()                                      # the warm-up's
        holder = threading.Thread(target=httpx.post, args=(url + "/v1/generate",),
                                  kwargs={"json": {"inputs": ["11/30/26"]}, "timeout": 60})
        holder.start()                                                  # occupies the engine (gated)
        while not gated.started_rows:
            time.sleep(0.01)
        body = json.dumps({"q": "Nov 3rd 1999. 1/5/2026", "source": "en", "target": "de"}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as raw:   # two sentences: two jobs
            raw.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 10
            while metric(url, "onnxformer_queue_depth") < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        deadline = time.monotonic() + 10
        while label_metric(url, "onnxformer_errors_total", kind="cancelled") < 1:
            assert time.monotonic() < deadline, "the server did not notice the client leave"
            time.sleep(0.01)
        assert metric(url, "onnxformer_queue_depth") == 0               # both its jobs left the queue
        gated.gate.set()
        holder.join(30)
        assert gated.started_rows == [1]                                # its sentences never decoded


@pytest.fixture(scope="module")
def nllb_url(nllb_bundle):
    models = ModelSet.load({"nllb": nllb_bundle}, SETTINGS)
    with serving(create_app(models)) as url:
        yield url


def nllb_reference(bundle_dir, text: str, src: str, tgt: str) -> str:
    """The tiny NLLB bundle's greedy translation of one sentence, as the compatible APIs decode it."""
    from runtime.bundle import load_bundle
    from runtime.generate import generate
    from runtime.request import Request, languages, search_options, target_options

    bundle = load_bundle(bundle_dir, provider="cpu")
    engine = bundle.engine
    framed, lead = languages(bundle.tokenizer, src, tgt)
    opts = search_options(engine, engine.max_len - len(lead), **target_options(framed, 1, lead=lead))
    hyps = generate(engine, Request.build(engine, [text], framed, opts))
    return to_outputs(hyps, engine.eos_id, bundle.tokenizer)[0].text


def test_a_multilingual_bundle_serves_its_languages(nllb_url, nllb_bundle):
    """NLLB's codes come from its manifest; LibreTranslate's and DeepL's ISO codes map onto them (de -> deu_Latn,
    EN-US -> eng_Latn), and /v1/generate takes them as src_lang and tgt_lang (422 without a target language)."""
    import deepl
    from libretranslatepy import LibreTranslateAPI

    text = "the quick fox jumps"
    (model,) = httpx.get(nllb_url + "/v1/models", timeout=30).json()["models"]
    languages = model["languages"]
    assert len(languages["codes"]) == 202 and {"de", "en", "zh", "zh-hant"} <= set(languages["target"])
    want_de, want_en = (nllb_reference(nllb_bundle, text, "fra_Latn", t) for t in ("deu_Latn", "eng_Latn"))
    assert want_de != want_en
    lt = LibreTranslateAPI(nllb_url)
    assert lt.translate(text, "fr", "de", timeout=60) == want_de
    assert any(entry["code"] == "fr" and "de" in entry["targets"] for entry in lt.languages(timeout=30))
    translator = deepl.Translator("any-key", server_url=nllb_url)
    assert translator.translate_text(text, source_lang="FR", target_lang="EN-US").text == want_en
    assert translator.translate_text(text, target_lang="DE").detected_source_lang == "FR"   # imported with fra_Latn
    body = {"inputs": [text], "src_lang": "fra_Latn", "tgt_lang": "deu_Latn", "max_new_tokens": 47}
    answer = httpx.post(nllb_url + "/v1/generate", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["outputs"][0]["text"] == want_de
    for change, message in (({"tgt_lang": None}, "this model is multilingual: give the target language"),
                            ({"tgt_lang": "german"}, "unknown tgt_lang 'german'")):
        refused = httpx.post(nllb_url + "/v1/generate", json={**body, **change}, timeout=30)
        assert refused.status_code == 422 and message in refused.json()["error"], refused.text


def test_client_codes_map_to_each_familys_codes():
    from toolkit.apps.languages import client_code, iso_codes

    assert [client_code(c) for c in ("EN-US", "pt-BR", "ZH-HANT", "zt", "zh-Hans", "de")] == \
        ["en", "pt", "zh-hant", "zh-hant", "zh", "de"]
    assert iso_codes(["eng_Latn", "zho_Hans", "zho_Hant", "ace_Arab", "arb_Arab", "ary_Arab"]) == \
        {"en": "eng_Latn", "zh": "zho_Hans", "zh-hant": "zho_Hant", "ar": "arb_Arab"}
    assert iso_codes(["en_XX", "pt_XX", "zh_CN"]) == {"en": "en_XX", "pt": "pt_XX", "zh": "zh_CN"}
    assert iso_codes(["en", "de"]) == {"en": "en", "de": "de"}                  # M2M100


def test_v1_generate_splits_texts_when_asked(dates_bundle):
    """POST /v1/generate with "split": true answers the records `onnxformer generate --json` prints (which splits
    by default): a long text decodes as its sentences and comes back as one record; without it an over-long text
    is refused, and split with stream is a 422 that says why."""
    import json

    from fastapi.testclient import TestClient

    from toolkit.apps.serve.app import ServeSettings, Service, create_app

    texts = [TEXT, LONG, "Nov 3rd 1999."]
    cli = generate_cli(dates_bundle, *texts, "--json", "--return-logprobs")
    want = [json.loads(line) for line in cli.stdout.splitlines()]
    assert cli.exit_code == 0 and len(want) == 3 and len({r["text"] for r in want}) == 3
    service = Service.load(dates_bundle, ServeSettings(provider="cpu"))
    with TestClient(create_app(service, start_in_background=False)) as client:
        got = client.post("/v1/generate", json={"inputs": texts, "split": True, "return_logprobs": True})
        assert got.status_code == 200, got.text
        for ours, theirs in zip(got.json()["outputs"], want):
            assert {k: v for k, v in ours.items() if k != "score"} == {k: v for k, v in theirs.items() if k != "score"}
            assert ours["score"] == pytest.approx(theirs["score"], abs=1e-5)
        whole = client.post("/v1/generate", json={"inputs": texts})
        assert whole.status_code == 422 and "maximum source length" in whole.text
        both = client.post("/v1/generate", json={"inputs": texts, "split": True, "stream": True})
        assert both.status_code == 422 and both.json()["error"].startswith('"split" decodes')
