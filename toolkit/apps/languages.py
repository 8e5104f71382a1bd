"""The language codes translation clients send, mapped to a multilingual model's own codes, in one table.

    iso_codes(["eng_Latn", "deu_Latn", "zho_Hant"])  # {"en": "eng_Latn", "de": "deu_Latn", "zh-hant": "zho_Hant"}
    client_code("EN-US"), client_code("pt-BR"), client_code("zt")     # "en", "pt", "zh-hant"

LibreTranslate and DeepL name languages by ISO 639-1 codes (DeepL in capitals, with a region for some targets:
EN-US, PT-BR, ZH-HANT); NLLB names them by ISO 639-3 code and script (eng_Latn), mBART by ISO 639-1 code and a
region (en_XX), M2M100 by the bare ISO 639-1 code (en). A client's code keeps only its language (a region says
nothing to these models) except the Chinese script: Traditional Chinese is "zh-hant" (LibreTranslate's "zt"), and a
model's code maps to the first client code it gives (NLLB's zho_Hans is "zh", zho_Hant "zh-hant").
"""

from __future__ import annotations

# ISO 639-3 (NLLB's language part) -> ISO 639-1, for the languages that have a two-letter code
ISO_639_1 = dict(pair.split(":") for pair in """
afr:af aka:ak als:sq amh:am arb:ar asm:as azj:az bak:ba bam:bm bel:be ben:bn bod:bo bos:bs bul:bg cat:ca ces:cs
cym:cy dan:da deu:de dzo:dz ekk:et ell:el eng:en epo:eo eus:eu ewe:ee fao:fo fij:fj fin:fi fra:fr gaz:om gla:gd
gle:ga glg:gl grn:gn guj:gu hat:ht hau:ha heb:he hin:hi hrv:hr hun:hu hye:hy ibo:ig ind:id isl:is ita:it jav:jv
jpn:ja kan:kn kas:ks kat:ka kaz:kk khk:mn khm:km kik:ki kin:rw kir:ky kmr:ku kon:kg kor:ko lao:lo lim:li lin:ln
lit:lt ltz:lb lug:lg lvs:lv mal:ml mar:mr mkd:mk mlt:mt mri:mi mya:my nld:nl nno:nn nob:nb npi:ne nya:ny oci:oc
ory:or pan:pa pbt:ps pes:fa plt:mg pol:pl por:pt quy:qu ron:ro run:rn rus:ru sag:sg san:sa sin:si slk:sk slv:sl
smo:sm sna:sn snd:sd som:so sot:st spa:es srd:sc srp:sr ssw:ss sun:su swe:sv swh:sw tam:ta tat:tt tel:te tgk:tg
tgl:tl tha:th tir:ti tsn:tn tso:ts tuk:tk tur:tr twi:tw uig:ug ukr:uk urd:ur uzn:uz vie:vi wol:wo xho:xh ydd:yi
yor:yo zho:zh zsm:ms zul:zu
""".split())
TRADITIONAL = "zh-hant"          # the one script clients tell apart (DeepL ZH-HANT, LibreTranslate zt)


def client_code(code: str) -> str:
    """A client's language code as this table compares it: lower case, the region dropped, zh-hant kept."""
    parts = code.strip().lower().replace("_", "-").split("-")
    if parts[0] == "zt" or (parts[0] == "zh" and ("hant" in parts[1:] or {"tw", "hk", "mo"} & set(parts[1:]))):
        return TRADITIONAL
    return parts[0]


def model_client_code(code: str) -> str | None:
    """The client code of one of a model's own codes (eng_Latn, en_XX, en); None where no ISO 639-1 code exists."""
    lang, _, rest = code.partition("_")
    if len(lang) == 3:
        base = ISO_639_1.get(lang)
        return TRADITIONAL if base == "zh" and rest == "Hant" else base
    if len(lang) == 2 and lang.isalpha():
        return TRADITIONAL if lang.lower() == "zh" and rest in ("TW", "HK") else lang.lower()
    return None


def iso_codes(codes) -> dict[str, str]:
    """{client code: model code} for a multilingual model's codes (the first model code of each client code)."""
    out: dict[str, str] = {}
    for code in codes:
        iso = model_client_code(code)
        if iso is not None:
            out.setdefault(iso, code)
    return out


def language_name(code: str) -> str:
    """The English name of a client code, as LibreTranslate's /languages gives it ("de": "German", "zh-hant":
    "Chinese (Traditional)"); a code that is no ISO 639-1 code (a task's target, e.g. "iso") is its own name."""
    import pycountry

    if code == TRADITIONAL:
        return "Chinese (Traditional)"
    found = pycountry.languages.get(alpha_2=code) if len(code) == 2 else None     # client codes are ISO 639-1
    return found.name if found is not None else code


__all__ = ["ISO_639_1", "client_code", "iso_codes", "language_name", "model_client_code"]
