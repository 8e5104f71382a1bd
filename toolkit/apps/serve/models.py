"""Several bundles in one server: their names, languages and services, and the routing between them.

    models = ModelSet.load({"de-en": Path("out/de-en"), "dates": Path("out/dates")}, settings,
                           languages={"dates": ("en", "iso")})
    models.pick("de-en")           # the Service a /v1/generate request names (a lone model needs no name)
    models.route("de", "en")       # the ServedModel that translates de -> en (LibreTranslate, DeepL endpoints)

A bundle's languages come from `--languages NAME=SRC:TGT` or else from its manifest's optional `languages` field,
{"source": ["de", "fr"], "target": ["en"]}. A multilingual bundle (its tokenizer lists its codes, NLLB's eng_Latn,
mBART's en_XX) translates between all of them: the compatible APIs name them by ISO 639-1 code (languages.py maps
"de" to deu_Latn or de_DE) and its requests decode with that src_lang and tgt_lang. Codes compare without case; a
target with a region (DeepL's "EN-US") also matches a bundle that declares the bare language ("en").
A bundle with none of these serves /v1/generate only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from runtime.errors import OnnxformerError
from toolkit.apps.languages import client_code, iso_codes, model_client_code
from toolkit.apps.serve.metrics import Metrics

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CODE = re.compile(r"^[A-Za-z]{2,3}([_-][A-Za-z0-9]{2,8})*$")


class ModelError(OnnxformerError):
    """A served-model spec that cannot be used (bad name, duplicate, unknown language code)."""


@dataclass
class ServedModel:
    """One bundle of the server: its name, its Service, and the languages it translates from and into."""

    name: str
    service: object                 # toolkit.apps.serve.app.Service
    source: tuple[str, ...] = ()
    target: tuple[str, ...] = ()
    native: dict[str, str] = field(default_factory=dict)   # multilingual: client code -> the model's own code

    def info(self) -> dict:
        """The /v1/models entry: name, languages, precision, memory (bundle bytes), provider, batching."""
        manifest = self.service.bundle.manifest
        return {"name": self.name, "bundle": str(self.service.bundle.path),
                "languages": {"source": list(self.source), "target": list(self.target),
                              **({"codes": list(self.service.tokenizer.languages)} if self.native else {})},
                "precision": manifest.get("precision"), "provider": self.service.bundle.provider,
                "bytes": sum(f["bytes"] for f in manifest["files"].values()),
                "tokenizer": self.service.tokenizer is not None, "max_len": self.service.engine.max_len,
                "batching": self.service.scheduler.kind, "state": self.service.state}

    def translates(self, source: str | None, target: str) -> bool:
        """Whether this model serves source -> target (source None: any source)."""
        base = target.split("-")[0]
        return ((target in self.target or base in self.target or client_code(target) in self.target)
                and (source is None or source in self.source or client_code(source) in self.source)
                and self.service.tokenizer is not None)

    @property
    def default_source(self) -> str:
        """The language a request without a source is read in (DeepL's detected_source_language)."""
        if self.native:
            return model_client_code(str(self.service.tokenizer.src_lang)) or ""
        return self.source[0] if self.source else ""

    def pair(self, source: str | None, target: str) -> tuple[str | None, str | None]:
        """(src_lang, tgt_lang): a multilingual model's own codes of the client's (source None: the model's
        default); (None, None) for a model without languages."""
        if not self.native:
            return None, None
        return (self.native.get(client_code(source)) if source else None), self.native.get(client_code(target))


def parse_specs(specs: list[str]) -> dict[str, Path]:
    """{name: bundle path} of `serve`'s NAME=BUNDLE arguments; a lone BUNDLE is named after its folder."""
    named: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            if len(specs) > 1:
                raise ModelError(f"{spec!r}: with several bundles, name each one: NAME=BUNDLE (e.g. dates={spec})")
            name, path = Path(spec).resolve().name, spec
        if not _NAME.match(name):
            raise ModelError(f"model name {name!r} must be letters, digits, '.', '_' or '-'; e.g. de-en=out/de-en")
        if name in named:
            raise ModelError(f"model name {name!r} is given twice; give each bundle its own name")
        named[name] = Path(path)
    return named


def parse_languages(specs: list[str], names) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """{name: (source codes, target codes)} of `--languages NAME=SRC:TGT` options (codes may be comma lists)."""
    out = {}
    for spec in specs:
        name, _, pair = spec.partition("=")
        source, colon, target = pair.partition(":")
        if not colon or name not in names:
            raise ModelError(f"--languages {spec!r}: write NAME=SRC:TGT with NAME one of the served models "
                             f"({', '.join(names)}), e.g. {next(iter(names))}=de:en")
        out[name] = (_codes(source, f"--languages {spec!r}"), _codes(target, f"--languages {spec!r}"))
    return out


def _codes(text: str, where: str) -> tuple[str, ...]:
    codes = tuple(c.strip().lower() for c in text.split(",") if c.strip())
    bad = [c for c in codes if not _CODE.match(c)] or ([] if codes else ["(none)"])
    if bad:
        raise ModelError(f"{where}: {bad[0]!r} is not a language code; use codes such as en, de, pt-br")
    return codes


def manifest_languages(manifest: dict, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(source codes, target codes) from a manifest's optional `languages` field (empty without one)."""
    field = manifest.get("languages")
    if field is None:
        return (), ()
    if not (isinstance(field, dict) and all(isinstance(field.get(k), list) for k in ("source", "target"))):
        raise ModelError(f"{where}: the manifest's 'languages' must be {{\"source\": [codes], \"target\": [codes]}}; "
                         f"fix it or pass --languages NAME=SRC:TGT")
    spec = f"{where}: the manifest's 'languages'"
    return _codes(",".join(map(str, field["source"])), spec), _codes(",".join(map(str, field["target"])), spec)


def multilingual_codes(tokenizer) -> dict[str, str]:
    """{ISO 639-1 code: model code} of a tokenizer whose target language is chosen per request; {} otherwise."""
    spec = getattr(tokenizer, "spec", None) or {}
    return iso_codes(tokenizer.languages) if spec.get("languages") and spec.get("target_start") else {}


class ModelSet:
    """The served models, by name; starts, stops and reports on all of them together."""

    def __init__(self, models: list[ServedModel]):
        self.models = {m.name: m for m in models}
        only = models[0].service.metrics if len(models) == 1 else None
        self.front = only or Metrics()      # refusals before a model was chosen, and the compatible APIs' refusals

    @classmethod
    def load(cls, bundles: dict[str, Path], settings, languages: dict | None = None) -> "ModelSet":
        from toolkit.apps.serve.app import Service

        models = []
        for name, path in bundles.items():
            service = Service.load(path, settings)
            native = multilingual_codes(service.tokenizer)
            source, target = ((languages or {}).get(name) or ((tuple(native),) * 2 if native else None)
                              or manifest_languages(service.bundle.manifest, str(path)))
            models.append(ServedModel(name, service, source, target, native))
        return cls(models)

    @classmethod
    def single(cls, service, name: str | None = None) -> "ModelSet":
        native = multilingual_codes(service.tokenizer)
        return cls([ServedModel(name or Path(service.bundle.path).name, service, tuple(native), tuple(native), native)])

    @property
    def services(self) -> list:
        return [m.service for m in self.models.values()]

    @property
    def ready(self) -> bool:
        return all(s.ready for s in self.services)

    @property
    def state(self) -> str:
        states = [s.state for s in self.services]
        return next((s for s in states if s != "ready"), "ready")

    def start(self) -> None:
        for service in self.services:
            service.start()

    def stop(self) -> None:
        for service in self.services:
            service.stop()

    def pick(self, name: str | None):
        """The Service a request names; LookupError (the one line) for a missing or unknown name."""
        if name is None:
            if len(self.models) == 1:
                return self.services[0]
            raise LookupError(f'this server serves several models; name one in "model": {", ".join(self.models)}')
        if name not in self.models:
            raise LookupError(f"unknown model {name!r}; the served models are: {', '.join(self.models)}")
        return self.models[name].service

    def route(self, source: str | None, target: str) -> ServedModel:
        """The model that translates source -> target (source None: any); LookupError naming the served pairs."""
        source, target = (source.lower() if source else None), target.lower()
        for model in self.models.values():
            if model.translates(source, target):
                return model
        pairs = ", ".join(f"{','.join(m.source)}->{','.join(m.target)}" for m in self.models.values() if m.target)
        raise LookupError(f"no served model translates {source or 'auto'} -> {target}; the served pairs are: "
                          f"{pairs or 'none (serve with --languages NAME=SRC:TGT)'}")

    def languages(self) -> list[tuple[str, list[str]]]:
        """(source code, its target codes) for every source language served, in order of first appearance."""
        out: dict[str, list[str]] = {}
        for model in self.models.values():
            if model.service.tokenizer is None:
                continue
            for code in model.source:
                targets = out.setdefault(code, [])
                targets += [t for t in model.target if t not in targets and t != code]
        return list(out.items())

    def metrics_text(self) -> bytes:
        """Prometheus text: a lone model's metrics as they are; several models' with a `model` label."""
        if len(self.models) == 1:
            return self.front.text()
        registry = CollectorRegistry()
        registry.register(_Labelled([("", self.front)] + [(m.name, m.service.metrics) for m in self.models.values()]))
        return generate_latest(registry)


class _Labelled:
    """A collector that merges several Metrics registries, adding the label model=NAME to every sample."""

    def __init__(self, sources: list[tuple[str, Metrics]]):
        self.sources = sources

    def collect(self):
        merged: dict[str, Metric] = {}
        for name, metrics in self.sources:
            for family in metrics.registry.collect():
                out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for s in family.samples:
                    out.add_sample(s.name, {**s.labels, "model": name}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
