// The bundle's tokenizer in the page, as runtime/tokenizer.py does it: ids equal, texts equal. It reads
// page-tokenizer.json (toolkit/apps/web/page_tokenizer.py writes it at `onnxformer web` time):
//   tokenizerOf(spec) -> { encode(text, srcLang?) -> ids, decode(ids) -> text, pieces?(text) }
// char: CharTokenizer; sentencepiece (Marian): pieces by @huggingface/tokenizers over the .spm converted to a
// Unigram tokenizer.json, ids by the bundle's vocabularies; hf-tokenizers (NLLB, mBART): its tokenizer.json.
import { Tokenizer } from "./tokenizers.min.mjs";

// --- the char tokenizer (CharTokenizer): ids 0-2 are pad, bos, eos ---
class CharTokenizer {
  constructor(spec) {
    this.specials = spec.specials;
    this.chars = [...spec.chars];
    this.toId = new Map(this.chars.map((c, i) => [c, i + this.specials.length]));
  }
  encode(text) {
    const unknown = [...new Set([...text].filter((c) => !this.toId.has(c)))];
    if (unknown.length) throw new Error(`input ${JSON.stringify(text)} has characters outside the vocabulary: ${unknown.join("")}`);
    return [...text].map((c) => this.toId.get(c));
  }
  decode(ids) {
    let out = "";
    for (const i of ids) {
      if (i === 2) break;
      if (i >= this.specials.length) out += this.chars[i - this.specials.length];
    }
    return out;
  }
}

const escapeRe = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

function cleanUpSpaces(text) {        // transformers' clean_up_tokenization (runtime.tokenizer._clean_up_spaces)
  for (const [a, b] of [[" .", "."], [" ?", "?"], [" !", "!"], [" ,", ","], [" ' ", "'"], [" n't", "n't"],
    [" 'm", "'m"], [" 's", "'s"], [" 've", "'ve"], [" 're", "'re"]]) text = text.split(a).join(b);
  return text;
}

// --- SentencePiece pieces, vocabulary ids (SentencePieceTokenizer: Marian) ---
class SentencePieceTokenizer {
  constructor(spec) {
    this.spec = spec;
    this.spm = new Tokenizer(spec.source_tokenizer, {});
    this.sourceVocab = new Map(Object.entries(spec.source_vocab));
    this.targetTokens = new Map(Object.entries(spec.target_vocab).map(([t, i]) => [i, t]));
    this.specials = spec.specials;
    this.unkId = this.sourceVocab.get(spec.unk);
    this.eosId = this.sourceVocab.get(spec.eos);
    this.skip = new Set(this.specials.map((t) => this.sourceVocab.get(t) ?? this.unkId));
    const byLength = [...this.specials].sort((a, b) => b.length - a.length);  // stable, as Python's sorted
    this.split = new RegExp(`(${byLength.map(escapeRe).join("|")})`);
    const d = spec.decode;
    this.decodeKind = new Map(d.pieces.map((p, i) => [p, d.kinds[i]]));
  }
  pieces(text) {                      // special tokens and a leading >>xx<< kept whole, each chunk by the .spm
    const out = [];
    for (let chunk of text.split(this.split)) {
      if (!chunk) continue;
      if (this.specials.includes(chunk)) { out.push(chunk); continue; }
      const end = chunk.startsWith(">>") ? chunk.indexOf("<<") : -1;
      if (end !== -1) { out.push(chunk.slice(0, end + 2)); chunk = chunk.slice(end + 2); }
      if (chunk) out.push(...this.spm.encode(chunk, { add_special_tokens: false }).tokens);
    }
    return out;
  }
  encode(text) {
    const ids = [...this.pieces(text).map((p) => this.sourceVocab.get(p) ?? this.unkId), this.eosId];
    return this.spec.prepend_bos ? [this.sourceVocab.get(this.spec.bos), ...ids] : ids;
  }
  decode(ids) {                       // SentencePieceProcessor.decode_pieces, then ▁ as spaces, stripped
    const d = this.spec.decode;
    let text = "";
    for (const i of ids) {
      if (this.skip.has(i)) continue;
      let token = this.targetTokens.get(i);
      if (token === undefined) token = (i >= 0 && i < d.pieces.length ? d.pieces[i] : "") || this.spec.unk;
      const kind = this.decodeKind.get(token);   // a piece the .spm lacks is copied as it is
      text += kind === "control" ? "" : kind === "unknown" ? d.unk_surface : token;
    }
    text = text.replaceAll("\u2581", " ").trim();
    return this.spec.clean_up_tokenization_spaces ? cleanUpSpaces(text) : text;
  }
}

// --- a Hugging Face tokenizer.json with our framing (FastTokenizer: NLLB, mBART, BART) ---
class FastTokenizer {
  constructor(spec) {
    this.spec = spec;
    this.tok = new Tokenizer(spec.tokenizer, {});      // parsed once: every source language shares it
    this.vocabSize = this.tok.get_vocab(true).size;     // get_vocab_size(with_added_tokens=True)
    this.framings = new Map();                          // source language -> [prefix ids, suffix ids]
  }
  framing(srcLang) {                  // the source framing's ids for a language (the bundle's src_lang by default)
    const lang = srcLang ?? this.spec.src_lang;
    if (!this.framings.has(lang)) {
      const names = { "{src_lang}": this.languageToken(lang) };
      this.framings.set(lang, [this.ids(this.spec.source_prefix || [], names), this.ids(this.spec.source_suffix || [], names)]);
    }
    return this.framings.get(lang);
  }
  languageToken(code) { return String(this.spec.language_token || "{lang}").replace("{lang}", String(code)); }
  ids(tokens, names) {
    return tokens.map((t) => {
      for (const [k, v] of Object.entries(names)) t = t.replaceAll(k, v);
      const i = this.tok.token_to_id(t);
      if (i === undefined || i === null) throw new Error(`the tokenizer has no token ${JSON.stringify(t)}`);
      return i;
    });
  }
  targetStartIds(tgtLang) {           // the ids forced after the decoder start (spec.target_start), or []
    if (!this.spec.target_start) return [];
    if (tgtLang === undefined) throw new Error("this model is multilingual: give tgtLang, e.g. " + this.spec.languages?.[0]);
    return this.ids(this.spec.target_start, { "{tgt_lang}": this.languageToken(tgtLang) });
  }
  encode(text, srcLang) {
    const [prefix, suffix] = this.framing(srcLang);
    return [...prefix, ...this.tok.encode(text, { add_special_tokens: false }).ids, ...suffix];
  }
  decode(ids) {
    const kept = ids.filter((i) => i < this.vocabSize);      // the library refuses an empty list: "" as tokenizers
    const text = kept.length ? this.tok.decode(kept, { skip_special_tokens: true }) : "";
    return this.spec.clean_up_tokenization_spaces ? cleanUpSpaces(text) : text;
  }
}

// encode(text, srcLang?): srcLang matters only to a multilingual tokenizer.json's framing (the others ignore it)
function tokenizerOf(spec) {
  if (spec.type === "char") return new CharTokenizer(spec);
  if (spec.type === "sentencepiece") return new SentencePieceTokenizer(spec);
  if (spec.type === "hf-tokenizers") return new FastTokenizer(spec);
  throw new Error(`tokenizer type ${spec.type} is not supported in the browser`);
}

export { CharTokenizer, SentencePieceTokenizer, FastTokenizer, tokenizerOf };
