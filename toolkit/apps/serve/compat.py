"""The APIs other translation clients already speak, over the served models, and API keys for every route.

    LibreTranslate  POST /translate   q (text or list), source (code or "auto"), target, format "text", api_key
                    GET  /languages   [{"code", "name", "targets"}]
    DeepL           POST /v2/translate   text (repeated or a list), target_lang, source_lang (optional)
                    GET  /v2/languages   ?type=source|target;  GET /v2/usage: this key's characters and limit
                    Authorization: DeepL-Auth-Key KEY
    ours            /v1/...: Authorization: Bearer KEY (when the server has --api-keys)
    OpenAI audio    /v1/audio/transcriptions, /v1/audio/translations (audio_routes.py): the same Bearer key,
                    refused in OpenAI's error shape {"error": {"message", "type", "param", "code"}}

A request goes to the model that serves its language pair (models.ModelSet.route). Errors keep each API's own
shape: LibreTranslate's {"error": "..."}, DeepL's {"message": "..."}, ours {"error": "..."}, and its statuses: a
missing or unknown key is 401 (DeepL: 403, which its clients read as an authorization failure), a key over its
monthly characters 403 (DeepL: 456, "quota exceeded"), over its request rate 429 with Retry-After.
/healthz, /docs and /languages stay open; /metrics needs a key when the server has --protect-metrics.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from toolkit.apps.languages import language_name
from toolkit.apps.serve.app import RequestError, error_response
from toolkit.apps.serve.audio_routes import KEY_CODES, openai_error
from toolkit.apps.serve.keys import ApiKeys, Denied, bearer
from toolkit.apps.serve.models import ModelSet
from toolkit.apps.serve.translate import read_fields, text_list, translate

KEY_STATUS = {"missing_key": 401, "invalid_key": 401, "quota": 403, "rate": 429}
DEEPL_KEY_STATUS = {"missing_key": 403, "invalid_key": 403, "quota": 456, "rate": 429}
UNLIMITED = 10 ** 12                     # DeepL's character_limit for an account without one


class KeyCheck:
    """ASGI middleware: our /v1 routes (and /metrics when protected) need `Authorization: Bearer KEY`."""

    def __init__(self, app, keys: ApiKeys, models: ModelSet):
        self.app, self.keys, self.models = app, keys, models

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1/") or (path == "/metrics" and self.keys.protect_metrics)):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            try:
                self.keys.admit(bearer(header))
            except Denied as exc:
                self.models.front.refused(exc.kind, "overloaded" if exc.kind == "rate" else "client_error")
                status = KEY_STATUS[exc.kind]
                refusal = openai_error(status, KEY_CODES[exc.kind], str(exc), retry_after=exc.retry_after) \
                    if path.startswith("/v1/audio/") else error_response(status, str(exc), exc.retry_after)
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_compat_routes(app: FastAPI, models: ModelSet, keys: ApiKeys | None = None) -> None:
    """The LibreTranslate and DeepL routes on `app`, and the key check of our own routes when there are keys."""
    keys = keys or ApiKeys([])
    if not keys.open:
        app.add_middleware(KeyCheck, keys=keys, models=models)
    _libretranslate(app, models, keys)
    _deepl(app, models, keys)


async def answer(models: ModelSet, work, shape, statuses) -> JSONResponse:
    """work()'s JSON answer, or the refusal in the API's shape and status (counted in the metrics)."""
    try:
        return JSONResponse(await work())
    except RequestError as exc:
        status, kind, retry, message = exc.status, exc.kind, exc.retry_after, str(exc)
    except Denied as exc:
        status, kind, retry, message = statuses[exc.kind], exc.kind, exc.retry_after, str(exc)
    except LookupError as exc:                                   # no served model for the language pair
        status, kind, retry, message = 400, "unsupported_language", None, exc.args[0]
    outcome = {429: "overloaded", 503: "overloaded", 499: "cancelled", 500: "error"}.get(status, "client_error")
    models.front.refused(kind, outcome)
    headers = {"Retry-After": str(retry)} if retry is not None else None
    return JSONResponse(shape(message), status_code=status, headers=headers)


async def charged(keys: ApiKeys, presented: str | None, texts: list[str], run):
    """await run() on the key's account: admitted (rate, quota) with the texts' characters, refunded if it fails."""
    characters = sum(map(len, texts))
    account = keys.admit(presented, characters)
    try:
        return await run()
    except BaseException:
        keys.refund(account, characters)
        raise


def _libretranslate(app: FastAPI, models: ModelSet, keys: ApiKeys) -> None:
    limit = models.services[0].limits.max_body_bytes

    @app.post("/translate", tags=["LibreTranslate"])
    async def libre_translate(request: Request):
        """LibreTranslate's translate: {"translatedText": text, or a list for a list of q}."""
        async def work():
            fields = await read_fields(request, limit)
            texts = text_list(fields.get("q"), "q")
            target, source = _code(fields, "target"), _code(fields, "source", optional=True)
            if str(fields.get("format", "text")) != "text":
                raise RequestError(400, "validation", f"format {fields['format']!r} is not supported; send "
                                                      f"format=text")
            source = None if source == "auto" else source
            key = _text(fields.get("api_key"))
            keys.find(key)                                       # a bad key is refused whatever it asks for
            model = models.route(source, target)
            out = await charged(keys, key, texts, lambda: translate(model, texts, source, request, target))
            return {"translatedText": out if isinstance(fields["q"], list) else out[0]}
        return await answer(models, work, lambda message: {"error": message}, KEY_STATUS)

    @app.get("/languages", tags=["LibreTranslate"])
    async def libre_languages():
        """LibreTranslate's languages: every served source language and the targets it translates into."""
        return [{"code": code, "name": language_name(code), "targets": targets} for code, targets in models.languages()]


def _deepl(app: FastAPI, models: ModelSet, keys: ApiKeys) -> None:
    limit = models.services[0].limits.max_body_bytes

    def deepl(work):
        return answer(models, work, lambda message: {"message": message}, DEEPL_KEY_STATUS)

    def account(request: Request):
        return keys.find(bearer(request.headers.get("authorization"), "DeepL-Auth-Key"))

    @app.post("/v2/translate", tags=["DeepL"])
    async def deepl_translate(request: Request):
        """DeepL's translate: {"translations": [{"detected_source_language", "text", "billed_characters"}]}."""
        async def work():
            fields = await read_fields(request, limit)
            texts = text_list(fields.get("text"), "text")
            target, source = _code(fields, "target_lang"), _code(fields, "source_lang", optional=True)
            key = bearer(request.headers.get("authorization"), "DeepL-Auth-Key")
            keys.find(key)                                       # a bad key is refused whatever it asks for
            model = models.route(source, target)
            out = await charged(keys, key, texts, lambda: translate(model, texts, source, request, target))
            detected = (source or model.default_source).upper()
            return {"translations": [{"detected_source_language": detected, "text": t, "billed_characters": len(s)}
                                     for s, t in zip(texts, out)]}
        return await deepl(work)

    @app.get("/v2/languages", tags=["DeepL"])
    async def deepl_languages(request: Request):
        """DeepL's languages: ?type=source (default) or target, as [{"language", "name"}]."""
        async def work():
            fields = await read_fields(request, limit)
            account(request)
            kind = fields.get("type", "source")
            if kind not in ("source", "target"):
                raise RequestError(400, "validation", f"type must be source or target, got {kind!r}")
            pairs = models.languages()
            codes = [c for c, _ in pairs] if kind == "source" else sorted({t for _, ts in pairs for t in ts})
            extra = {"supports_formality": False} if kind == "target" else {}
            return [{"language": c.upper(), "name": c.upper(), **extra} for c in codes]
        return await deepl(work)

    @app.get("/v2/usage", tags=["DeepL"])
    async def deepl_usage(request: Request):
        """DeepL's usage: this key's characters this month and its limit."""
        async def work():
            used = account(request)
            return {"character_count": used.used_chars, "character_limit": used.chars or UNLIMITED}
        return await deepl(work)


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def _code(fields: dict, name: str, optional: bool = False) -> str | None:
    """A language code field, lower case; RequestError (400) when a required one is missing or not a text."""
    value = fields.get(name)
    if value is None or value == "":
        if optional:
            return None
        raise RequestError(400, "validation", f"{name!r} is required: the language code to translate into")
    if not isinstance(value, str):
        raise RequestError(400, "validation", f"{name!r} must be a language code such as 'de', got {value!r}")
    return value.lower()
