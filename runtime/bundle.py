"""Load a bundle: validate the manifest and hashes, start both sessions, check their interfaces, load the tokenizer.

    bundle = load_bundle("out/bundle", provider="auto")
    hyps = generate_ids(bundle.engine, [[5, 6, 7]], SearchOptions(beam=4))
    print(bundle.provider)                      # "cpu" or "cuda": what "auto" chose

Every way a bundle can be broken (missing file, any changed file: graphs, .ort graphs, tokenizer, operator config
or whatever else the manifest lists; older or newer format, graph whose interface differs from its manifest, a
manifest whose model config or decoder_layout does not match its graphs) is a BundleError when loading, never a
crash at run time.
"""

from __future__ import annotations

import mmap
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from runtime.errors import BundleError, ProviderError, TokenizerError
from runtime.manifest import GRAPHS, decoder_layout, manifest_specs, read_manifest, verify_hashes
from runtime.ort_engine import OrtEngine
from runtime.session import (Arg, OnDemandSession, SessionConfig, choose_provider, installed_onnxruntime,
                             int8_saturates, make_session)
from runtime.shortlist import FEEDS, Shortlist, ShortlistWeight
from runtime.spec import (GraphSpec, config_field_of, feature_shape, graph_specs, parse_cache_name,
                          shortlist_decoder_spec, source_vocab_size)
from runtime.tokenizer import CharTokenizer, load_tokenizer

_LOAD_ERRORS = (ort_errors.Fail, ort_errors.InvalidGraph, ort_errors.InvalidProtobuf, ort_errors.NotImplemented,
                ort_errors.RuntimeException, ort_errors.InvalidArgument, ort_errors.NoSuchFile,
                UnicodeDecodeError)          # onnxruntime's message quoting a corrupted external-data path
_MODEL_KEYS = ("vocab_size", "d_model", "n_heads", "n_decoder_layers", "max_len", "pad_id", "bos_id", "eos_id")
_ORT_TYPES = {"tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(float)": "float32",
              "tensor(float16)": "float16", "tensor(int8)": "int8", "tensor(uint8)": "uint8"}
_SPEC_TYPES = {dtype: ort_type for ort_type, dtype in _ORT_TYPES.items()}


@dataclass
class Bundle:
    """A loaded bundle: its engine (runtime.generate.Engine), tokenizer, chosen provider and manifest."""

    path: Path
    manifest: dict
    engine: OrtEngine
    tokenizer: CharTokenizer | None
    provider: str                   # "cpu" | "cuda"
    files: dict[str, str]           # graph name -> file the session was made from (.onnx or .ort)


def load_bundle(path: str | Path, provider: str = "auto", threads: int | None = None,
                session_options: SessionConfig | None = None, io_binding: bool | None = None,
                one_graph_at_a_time: bool = False, shortlist: bool = True, tokenizer: bool = True) -> Bundle:
    """Validate and load a bundle directory; `threads` sets intra-op threads, `io_binding` None = per provider.

    `one_graph_at_a_time` (CPU without IO binding; for one-shot use such as `onnxformer generate`): each graph's session is made when
    first used and the other one is released then, so the encoder's weights are gone before the decoder's are
    loaded (base int8 bundle: the peak resident memory of a 64-token request without the 18 MiB of the encoder's
    prepacked weights beside the decoder's). A graph that does not match the manifest then fails at its first use
    (still a BundleError). Servers and benchmarks, which encode and decode in turn, keep both sessions.

    `shortlist`: load the bundle's vocabulary shortlist (its map and decoder graph, a third session) where it has
    one; requests then decode on it unless their options say shortlist=False. False: the bundle loads as without.

    `tokenizer=False` (callers that feed token ids, as the peer race's worker does): the tokenizer is not loaded
    (`bundle.tokenizer` is None; its files are still verified by hash). Parsing a Hugging Face tokenizer.json of T5's
    32,100-piece Unigram vocabulary adds 25 MiB resident, 17 of them to a batch-1 run's peak (benchmarks/RESULTS.md,
    "T5 against its peers")."""
    path = Path(path)
    manifest = read_manifest(path)                                    # format, version, fields
    verify_hashes(path, manifest)                                     # every listed file present and unchanged
    bad = [k for k in _MODEL_KEYS if not isinstance(manifest["model"].get(k), int)]
    if bad:
        raise BundleError(f"bundle {path}: the manifest's model config lacks {', '.join(bad)}; re-export the bundle")
    config = (session_options or SessionConfig()).with_(intra_op_threads=threads)
    chosen = choose_provider(provider)
    tables = shared_tables(path, manifest) if chosen == "cpu" else ({}, None)   # one mapping for every session
    try:
        sessions, files = _sessions(path, manifest, chosen, config, tables, one_graph_at_a_time and chosen == "cpu"
                                    and not io_binding)               # host outputs: they outlive the session
    except ProviderError:
        if provider != "auto" or chosen == "cpu":
            raise
        chosen = "cpu"                                                # onnxruntime-gpu whose CUDA libraries are missing
        tables = shared_tables(path, manifest)
        sessions, files = _sessions(path, manifest, chosen, config, tables)
    vocab = _shortlist(path, manifest, chosen, config, tables) if shortlist and manifest.get("shortlist") else None
    engine = OrtEngine(sessions["encoder"], sessions["decoder"], manifest["model"], chosen, io_binding,
                       decoder_layout(manifest), vocab)
    if chosen == "cpu" and weight_bits(manifest) == 8 and int8_saturates():
        warnings.warn(f"bundle {path} has 8-bit int8 weights, and this CPU's int8 kernel saturates their products "
                      f"(x86 without VNNI): its tokens will differ from what its gate measured (up to 22% of "
                      f"them on the models measured); optimize the fp32 bundle again with --weight-bits 7 (the "
                      f"default on such a CPU) for int8 weights exact on every CPU", RuntimeWarning,
                      stacklevel=2)
    return Bundle(path, manifest, engine, _tokenizer(path, manifest) if tokenizer else None, chosen, files)


def weight_bits(manifest: dict) -> int | None:
    """The bits of an int8 bundle's quantized weights (8 for bundles from before 7-bit recipes); None otherwise."""
    if manifest.get("precision") != "int8":
        return None
    options = (manifest.get("source") or {}).get("options") or {}
    return 8 if options.get("blocks") else options.get("weight_bits") or 8


def _sessions(path: Path, manifest: dict, provider: str, config: SessionConfig,
              tables: tuple[dict, LookupPages | None], on_demand: bool = False) -> tuple[dict, dict]:
    """Both graphs' sessions, each checked against the manifest and against the interface the engine feeds
    (tables: shared_tables' answer, or ({}, None); on_demand: OnDemandSessions that release each other, each
    checked when made)."""
    recorded = manifest_specs(manifest)
    expected = graph_specs(manifest["model"], layout=decoder_layout(manifest))
    sessions, files = {}, {}
    shared, pages = tables
    fixed = feature_shape(manifest["model"]) is not None               # an audio encoder: one input shape
    for name in GRAPHS:
        _check_recorded(path, name, recorded[name], expected[name])
        file = graph_file(manifest, name, provider)
        onnx_graph = file.endswith(".onnx")                            # .ort graphs embed their weights

        def make(file=path / file, options=config.for_graph(name, fixed), given=shared if onnx_graph else None,
                 spec=recorded[name], pages=pages if onnx_graph else None):
            session = _session(file, provider, options, given)
            _check_session(file, session, spec)
            return session if pages is None else PagesReturned(session, pages)

        sessions[name] = make
        files[name] = file
    if on_demand:
        return one_at_a_time(sessions, recorded), files
    made = {name: sessions[name]() for name in reversed(GRAPHS)}       # the decoder first: its load transient (the
    return {name: made[name] for name in GRAPHS}, files              # head's source mapped while packed) then
                                                                     # comes before the encoder's weights


def one_at_a_time(makers: dict[str, Callable[[], ort.InferenceSession]],
                  specs: dict[str, GraphSpec]) -> dict[str, OnDemandSession]:
    """The encoder's and the decoder's sessions as OnDemandSessions that release each other: each made when first
    used, the other dropped (and its memory given back) first, so one graph's weights are in memory at a time.
    specs: each graph's interface (answered until its session exists)."""
    sessions = {name: OnDemandSession(makers[name], *_interface(specs[name])) for name in GRAPHS}
    for name, other in (("encoder", "decoder"), ("decoder", "encoder")):
        sessions[name].before = _release(weakref.ref(sessions[other]))
    return sessions


def _release(other: weakref.ref) -> Callable[[], None]:
    """Release the other graph's session, which is held weakly: a pair that held each other would be a reference
    cycle, and a dropped engine's sessions would wait for Python's cyclic collector instead of going at once."""
    def release() -> None:
        session = other()
        if session is not None:
            session.release()
    return release


def _shortlist(path: Path, manifest: dict, provider: str, config: SessionConfig,
               tables: tuple[dict, LookupPages | None]) -> tuple[Shortlist, object, ShortlistWeight | None]:
    """The bundle's shortlist map, its decoder's session and the projection table its rows are gathered from, each
    checked against the manifest like the graphs (tables: the shared ones the main sessions read)."""
    record, model = manifest["shortlist"], manifest["model"]
    weight = record.get("weight")
    if weight is not None and (not isinstance(weight, dict) or weight.get("feed") not in FEEDS
                               or not isinstance(weight.get("shape"), list) or len(weight["shape"]) != 2):
        raise BundleError(f"bundle {path}: the manifest's shortlist weight record is not a table with a feed "
                          f"({' or '.join(FEEDS)}) and a 2-D shape; rebuild it with onnxformer shortlist")
    recorded = manifest_specs({"graphs": {"decoder": record["decoder"]}})["decoder"]
    expected = shortlist_decoder_spec(graph_specs(model, layout=decoder_layout(manifest))["decoder"], weight)
    _check_recorded(path, "shortlist decoder", recorded, expected)
    file = path / record["decoder"]["file"]
    shared, pages = tables                                            # ({}, None) off the CPU
    session = _session(file, provider, config.for_graph("decoder"), shared)
    _check_session(file, session, recorded)
    session = session if pages is None else PagesReturned(session, pages)
    table = None
    if weight is not None:
        array = _mapped_tensors(path, weight["file"], [{**weight, "name": "shortlist weight"}], "shortlist",
                                "rebuild the shortlist with onnxformer shortlist")
        table = ShortlistWeight(array["shortlist weight"], weight["feed"])
        if table.table.shape[0] != model["vocab_size"]:
            raise BundleError(f"bundle {path}: the shortlist weight has {table.table.shape[0]} rows, the model's "
                              f"vocabulary {model['vocab_size']}; rebuild it with onnxformer shortlist")
    return Shortlist.load(path / record["file"], source_vocab_size(model), model["vocab_size"]), session, table


def _interface(spec: GraphSpec) -> tuple[list[Arg], list[Arg]]:
    """A graph's inputs and outputs as onnxruntime names them (NodeArg's name, type, shape), from its spec."""
    return tuple([Arg(t.name, _SPEC_TYPES.get(t.dtype, t.dtype), list(t.shape)) for t in side]
                 for side in (spec.inputs, spec.outputs))


def graph_file(manifest: dict, name: str, provider: str) -> str:
    """The file to load: the ORT-format (.ort) graph when the bundle lists one and we run on CPU, else the .onnx."""
    ort_graphs = manifest.get("ort_graphs") or {}
    if provider == "cpu" and name in ort_graphs:                      # .ort files are converted for the CPU provider
        return ort_graphs[name]["file"]
    return manifest["graphs"][name]["file"]


RETURNED_BYTES = 16 * 1024 * 1024       # shared tables at least this large get their pages back after each run


class LookupPages:
    """The pages of the large shared tables (an int8 bundle's token table [V, D]) that a run touched, given back
    after each run (madvise MADV_DONTNEED on the read-only mapping: the file's pages stay in the page cache, a
    later lookup maps them again).

    A token lookup reads one row of the table, but the kernel maps more than that page (fault-around, and on
    recent kernels a whole large folio of the page cache: up to 2 MiB a lookup), so a process that looked up
    the tokens of a few requests held most of the table mapped beside the projection's packed copy: the NLLB-600M
    int8 table twice. Giving them back costs tens of microseconds a run (benchmarks/RESULTS.md, "The tied table
    held once"), which is why only tables of RETURNED_BYTES or more get it, and only tables with a row per token:
    a bundle made before exporters/tied_table keeps its table [D, V], where every lookup reads a byte of each row,
    and giving those pages back would cost a fault per row each step."""

    def __init__(self, mapped: mmap.mmap, spans: list[tuple[int, int]]):
        self.mapped, self.spans = mapped, spans

    def give_back(self) -> None:
        for start, length in self.spans:
            self.mapped.madvise(mmap.MADV_DONTNEED, start, length)


class PagesReturned:
    """An InferenceSession that gives the shared tables' pages back after each run (LookupPages)."""

    def __init__(self, session: ort.InferenceSession, pages: LookupPages):
        self.session, self.pages = session, pages

    def run(self, *args, **kwargs):
        try:
            return self.session.run(*args, **kwargs)
        finally:
            self.pages.give_back()

    def run_with_iobinding(self, *args, **kwargs):
        try:
            return self.session.run_with_iobinding(*args, **kwargs)
        finally:
            self.pages.give_back()

    def __getattr__(self, name):
        return getattr(self.session, name)


def shared_tables(path: Path, manifest: dict) -> tuple[dict[str, ort.OrtValue], LookupPages | None]:
    """One OrtValue per tensor both graphs read from weights.data (the int8 embedding table, the positional table),
    over one read-only mapping of the file, for both sessions; and where some of them are large, their
    LookupPages.

    Each session otherwise maps the file itself: the same page-cache pages, but resident in each mapping, so a
    process's resident memory counts the table twice (base int8 bundle: 4 MiB of 8000 x 512 int8; 30 MiB at the
    opus-mt vocabulary). Sizes, offsets and dtypes come from the manifest's shared_weights record (the file's hash
    was verified before); a record that does not fit the file is a BundleError."""
    record = manifest.get("shared_weights")
    if not isinstance(record, dict) or not isinstance(record.get("tensors"), list) or not isinstance(record.get("file"), str):
        return {}, None                             # (a named file is listed, hashed and verified by read_manifest)
    wanted = [t for t in record["tensors"] if isinstance(t, dict) and isinstance(t.get("graphs"), list)
              and len(t["graphs"]) > 1]
    if not wanted:
        return {}, None
    arrays, mapped = _mapped_tensors(path, record["file"], wanted, "shared_weights", mapping=True)
    model = manifest.get("model") or {}
    vocabularies = {model.get("vocab_size"), source_vocab_size(model) if model.get("vocab_size") else None}
    spans = [(t["offset"], t["length"]) for t in wanted if t["length"] >= RETURNED_BYTES    # a row per token: a
             and t["shape"] and t["shape"][0] in vocabularies and t["offset"] % mmap.PAGESIZE == 0]   # lookup is a row
    pages = LookupPages(mapped, spans) if spans and hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED") else None
    return {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}, pages


def _mapped_tensors(path: Path, name: str, tensors: list[dict], record: str,
                    fix: str = "re-export or re-optimize the bundle", mapping: bool = False):
    """Read-only arrays over one mapping of the bundle's file `name`, one per entry of `tensors` (name, dtype,
    shape, offset, length: the manifest's `record` describes them; the file's hash was verified before); an entry
    that does not fit the file is a BundleError."""
    try:
        with open(path / name, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise BundleError(f"bundle {path}: cannot map {name} ({exc}); copy the bundle again") from None
    values = {}
    for t in tensors:
        try:
            if not isinstance(t.get("name"), str) or not t["name"] or not isinstance(t.get("dtype"), str):
                raise ValueError("no tensor name or dtype")
            if not isinstance(t.get("length"), int) or not isinstance(t.get("shape"), list):
                raise ValueError("no length or shape")
            dtype, shape, offset = np.dtype(t["dtype"]), tuple(int(d) for d in t["shape"]), int(t["offset"])
            if dtype.kind not in "fiub" or any(d < 0 for d in shape):
                raise ValueError(f"not a numeric tensor: {t['dtype']} {list(shape)}")
            count = int(np.prod(shape, dtype=np.int64))
            if t["length"] != count * dtype.itemsize or offset < 0 or offset + t["length"] > len(mapped):
                raise ValueError("offset or length outside the file")
            values[t["name"]] = np.frombuffer(mapped, dtype=dtype, count=count, offset=offset).reshape(shape)
        except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise BundleError(f"bundle {path}: the manifest's {record} entry {t.get('name')!r} does not describe "
                              f"a tensor of {name} ({(str(exc).splitlines() or [type(exc).__name__])[0]}); "
                              f"{fix}") from None
    return (values, mapped) if mapping else values


def _session(file: Path, provider: str, config: SessionConfig,
             initializers: dict[str, ort.OrtValue] | None = None) -> ort.InferenceSession:
    try:
        return make_session(file, provider, config, initializers)
    except _LOAD_ERRORS as exc:
        first = str(exc).strip().splitlines()[0][:300]
        raise BundleError(f"{file} cannot be loaded by {installed_onnxruntime()} on {provider} ({first}); re-export "
                          f"or re-optimize the bundle for this provider (e.g. --target {provider})") from None


def _check_recorded(path: Path, name: str, recorded: GraphSpec, expected: GraphSpec) -> None:
    """The manifest's interface must be the one the runtime feeds for its model config and decoder layout: names
    in order, dtypes, ranks, and every fixed dim (a manifest whose config was edited is refused here, naming the
    field, not by onnxruntime at the first request)."""
    _check_layers(path, name, recorded, expected)
    got = [(t.name, t.dtype, len(t.shape)) for t in recorded.inputs + recorded.outputs]
    want = [(t.name, t.dtype, len(t.shape)) for t in expected.inputs + expected.outputs]
    for found, wanted in zip_longest(got, want):
        if found != wanted:
            raise BundleError(f"bundle {path}: the manifest's {name} interface differs from the model config and "
                              f"decoder_layout (found {found}, expected {wanted}); re-export the bundle with this "
                              f"onnxformer")
    for r, e in zip(recorded.inputs + recorded.outputs, expected.inputs + expected.outputs):
        for axis, (dim, wanted) in enumerate(zip(r.shape, e.shape)):
            if isinstance(dim, int) and isinstance(wanted, int) and dim != wanted:
                raise BundleError(f"bundle {path}: the manifest's model config does not match its graphs: "
                                  f"{config_field_of(r.name, axis)} gives {name} {r.name} size {wanted} at axis "
                                  f"{axis}, the graph has {dim}; copy the bundle again or re-export it")


def _check_layers(path: Path, name: str, recorded: GraphSpec, expected: GraphSpec) -> None:
    """The decoder layers the config names against the layers of the caches the graph takes or gives."""
    layers = [{p[1] for p in map(parse_cache_name, s.input_names + s.output_names) if p} for s in (recorded, expected)]
    if len(layers[0]) != len(layers[1]):
        raise BundleError(f"bundle {path}: the manifest's model config says n_decoder_layers {len(layers[1])}, the "
                          f"{name} graph takes the caches of {len(layers[0])}; copy the bundle again or re-export it")


def _check_session(file: Path, session: ort.InferenceSession, spec: GraphSpec) -> None:
    """The loaded graph's real inputs and outputs must match the manifest: names, element types, fixed dims."""
    for kind, actual, wanted in (("input", session.get_inputs(), spec.inputs),
                                 ("output", session.get_outputs(), spec.outputs)):
        by_name = {a.name: a for a in actual}
        missing = [t.name for t in wanted if t.name not in by_name]
        extra = sorted(set(by_name) - {t.name for t in wanted})
        if missing or extra:
            raise BundleError(f"{file}: graph {kind}s do not match the manifest (missing {missing[:3]}, "
                              f"unexpected {extra[:3]}); re-export the bundle")
        for t in wanted:
            a = by_name[t.name]
            dtype = _ORT_TYPES.get(a.type, a.type)
            fixed_mismatch = len(a.shape) != len(t.shape) or any(
                isinstance(d, int) and isinstance(g, int) and d != g for d, g in zip(t.shape, a.shape))
            if dtype != t.dtype or fixed_mismatch:
                raise BundleError(f"{file}: {kind} {t.name} is {dtype} {list(a.shape)}, the manifest says "
                                  f"{t.dtype} {list(t.shape)}; re-export the bundle")


def _tokenizer(path: Path, manifest: dict) -> CharTokenizer | None:
    name = manifest.get("tokenizer")
    if not name:
        return None
    try:
        tokenizer = load_tokenizer(path / name)
    except TokenizerError as exc:
        raise BundleError(f"bundle {path}: {exc}; copy the bundle again or re-export it") from None
    if tokenizer.vocab_size > manifest["model"]["vocab_size"] or \
            getattr(tokenizer, "src_vocab_size", 0) > source_vocab_size(manifest["model"]):
        raise BundleError(f"bundle {path}: tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                          f"vocab_size {manifest['model']['vocab_size']}; re-export the bundle")
    return tokenizer
