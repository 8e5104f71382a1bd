"""Export: a model and its graph specs in, encoder.onnx and decoder.onnx out (torch.onnx dynamo exporter).

    EncoderGraph   (input_ids, attention_mask) -> (encoder_hidden_states, present.{i}.encoder.key/value ...)
    AudioEncoderGraph  (input_features) -> the same outputs (Whisper: an audio encoder has no mask)
    DecoderGraph   (input_ids, encoder_attention_mask, position_ids, decoder_attention_mask, *past_key_values in spec order)
                   -> (logits, present.{i}.decoder.key/value ...)

Every name, the order of the flattened caches and every dynamic axis come from runtime/spec.py. One
decoder graph serves the first step (past_len 0) and every cached step (any new_len >= 1).
"""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from pathlib import Path
from typing import Callable

import onnx
import torch
from torch.export import Dim

import runtime.spec as S
from exporters.bundle import build_manifest, check_destination, copy_tokenizer, graph_entry, stage_bundle, write_manifest
from exporters.logs import quiet_loggers
from exporters.shared_weights import graph_data, save_graph, share_weights, shared_bytes
from exporters.validate import check_finite, check_graph, proto_weights
from toolkit.reference.errors import ConfigError
from toolkit.parity import ParityError
from runtime.spec import CROSS, PAST, PRESENT, SELF, GraphSpec, cache_name, graph_specs
from toolkit.reference.checkpoint import TOKENIZER, load_checkpoint
from toolkit.reference.model import Transformer
from toolkit.parity.graphs import graph_parity

DEFAULT_OPSET = 20
SUPPORTED_OPSETS = range(18, 24)            # 18..23: what the dynamo exporter and onnxruntime 1.32 both handle
MAX_DIM = 65536                             # upper bound for every dynamic axis
TRACE_SIZES = {S.BATCH: 3, S.SRC_LEN: 7, S.NEW_LEN: 2, S.PAST_LEN: 5}   # never 0 or 1: torch.export would specialize
N_DECODER_FIXED = 4                         # decoder inputs before the caches: ids, encoder mask, positions, key mask


class EncoderGraph(torch.nn.Module):
    """encode() with its outputs flattened in the encoder spec's order."""

    def __init__(self, model: Transformer, spec: GraphSpec):
        super().__init__()
        self.model, self.output_names = model, spec.output_names

    def forward(self, input_ids, attention_mask):
        memory, cross = self.model.encode(input_ids, attention_mask)
        named = {"encoder_hidden_states": memory}
        for i, (k, v) in enumerate(cross):
            named[cache_name(PRESENT, i, CROSS, "key")], named[cache_name(PRESENT, i, CROSS, "value")] = k, v
        return tuple(named[n] for n in self.output_names)


class AudioEncoderGraph(EncoderGraph):
    """encode() of an audio encoder (config.features): log-mel features in, no mask."""

    def forward(self, input_features):
        return super().forward(input_features, None)


def encoder_graph(model: Transformer, spec: GraphSpec) -> EncoderGraph:
    """The encoder's wrapper for the model's input kind (token ids and mask, or features)."""
    return (AudioEncoderGraph if model.config.features else EncoderGraph)(model, spec)


class DecoderGraph(torch.nn.Module):
    """decode_step() taking the caches as flat arguments and returning them flat, in the decoder spec's order."""

    def __init__(self, model: Transformer, spec: GraphSpec):
        super().__init__()
        self.model, self.output_names = model, spec.output_names
        self.layers = model.config.n_decoder_layers
        self.cache_index = {name: i for i, name in enumerate(spec.input_names[N_DECODER_FIXED:])}

    def forward(self, input_ids, encoder_attention_mask, position_ids, decoder_attention_mask, *caches):
        def get(i, attn, kv):
            return caches[self.cache_index[cache_name(PAST, i, attn, kv)]]

        past = [(get(i, SELF, "key"), get(i, SELF, "value")) for i in range(self.layers)]
        cross = [(get(i, CROSS, "key"), get(i, CROSS, "value")) for i in range(self.layers)]
        logits, presents = self.model.decode_step(input_ids, encoder_attention_mask, past, cross, position_ids,
                                                  decoder_attention_mask)
        named = {"logits": logits}
        for i, (k, v) in enumerate(presents):
            named[cache_name(PRESENT, i, SELF, "key")], named[cache_name(PRESENT, i, SELF, "value")] = k, v
        return tuple(named[n] for n in self.output_names)


def check_opset(opset: int) -> None:
    if opset not in SUPPORTED_OPSETS:
        raise ConfigError(f"opset {opset} is not supported; choose one in {SUPPORTED_OPSETS.start}.."
                          f"{SUPPORTED_OPSETS.stop - 1} (default {DEFAULT_OPSET})")


def dynamic_shapes(spec: GraphSpec) -> dict[str, dict[int, Dim]]:
    """{input name: {axis: Dim}} from the spec's symbolic dims; past_len may be 0 (the first decoder step)."""
    dims = {name: Dim(name, min=0 if name == S.PAST_LEN else 1, max=MAX_DIM) for name in TRACE_SIZES}
    return {t.name: {axis: dims[d] for axis, d in enumerate(t.shape) if isinstance(d, str)} for t in spec.inputs}


def example_input(t: S.TensorSpec, config, gen: torch.Generator) -> torch.Tensor:
    """A tracing input of the spec's shape with TRACE_SIZES for its symbolic dims (seeded; global RNG untouched)."""
    shape = [TRACE_SIZES[d] if isinstance(d, str) else d for d in t.shape]
    if t.name == S.POSITION_IDS:                            # past_len + 0..new_len-1 (positions index the table)
        return (torch.arange(shape[1]) + TRACE_SIZES[S.PAST_LEN]).expand(shape).contiguous()
    if t.dtype == "int64":
        if "mask" in t.name:
            mask = torch.ones(shape, dtype=torch.long)
            mask[0, -2:] = 0                                # one padded row, so masking is traced
            return mask
        vocab = min(config.vocab_size, config.source_vocab_size)      # valid as source and as target ids
        return torch.randint(min(3, vocab - 1), vocab, shape, generator=gen)
    return torch.randn(shape, generator=gen)


def _export(module: torch.nn.Module, spec: GraphSpec, config, path: Path, opset: int) -> None:
    """Trace one wrapper with the dynamo exporter, name its output dims after the spec, save it to path (its
    weights in path's data file, exporters/shared_weights.save_graph)."""
    device = next(module.parameters()).device
    gen = torch.Generator().manual_seed(0)
    args = tuple(example_input(t, config, gen).to(device) for t in spec.inputs)
    shapes = dynamic_shapes(spec)
    if isinstance(module, DecoderGraph):                  # varargs: (ids, mask, tuple of per-cache dims)
        names = spec.input_names
        fixed = N_DECODER_FIXED
        dyn = (*(shapes[n] for n in names[:fixed]), tuple(shapes[n] for n in names[fixed:]))
    else:
        dyn = shapes
    quiet = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(quiet), quiet_loggers("torch.onnx", "torch.export", "torch._dynamo", "onnxscript"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, None, input_names=spec.input_names, output_names=spec.output_names,
                                    dynamic_shapes=dyn, opset_version=opset, dynamo=True, verbose=False)
    save_graph(program.model, path)          # the weights beside the graph, never one protobuf message over 2 GB
    del program
    proto = onnx.load(str(path), load_external_data=False)
    name_output_dims(proto, spec)
    proto.doc_string = f"onnxformer {spec.name} graph"
    onnx.save_model(proto, str(path))


def name_output_dims(proto: onnx.ModelProto, spec: GraphSpec) -> None:
    """Give derived output dims their spec names: the exporter writes 'past_len + new_len' where the spec says total_len."""
    derived = {S.TOTAL_LEN: {f"{S.PAST_LEN} + {S.NEW_LEN}", f"{S.NEW_LEN} + {S.PAST_LEN}"}}
    outputs = {t.name: t for t in spec.outputs}
    for value in proto.graph.output:
        want = outputs.get(value.name)
        if want is None:
            continue
        for dim, name in zip(value.type.tensor_type.shape.dim, want.shape):
            if isinstance(name, str) and dim.dim_param in derived.get(name, ()):
                dim.dim_param = name


def export_graphs(model: Transformer, out_dir: Path, opset: int = DEFAULT_OPSET,
                  progress: Callable[[str], None] | None = None) -> dict[str, tuple[Path, onnx.ModelProto]]:
    """Write encoder.onnx and decoder.onnx into out_dir, each checked by onnx and against its spec; returns
    {name: (path, the checked model)}. The caller checks the opset (export_model)."""
    progress = progress or (lambda msg: None)
    config = model.config
    specs = graph_specs(config.to_dict())
    was_training = model.training
    model.eval()
    paths = {}
    try:
        for name, wrapper in (("encoder", encoder_graph), ("decoder", DecoderGraph)):
            start = time.perf_counter()
            path = Path(out_dir) / f"{name}.onnx"
            _export(wrapper(model, specs[name]), specs[name], config, path, opset)
            checked = check_graph(path, specs[name])
            check_finite(proto_weights(checked, path.parent), f"{name}.onnx")
            size = path.stat().st_size + graph_data(path).stat().st_size
            progress(f"exported {name}.onnx ({size / 1e6:.1f} MB, opset {opset}) "
                     f"in {time.perf_counter() - start:.1f} s; onnx checker and spec check passed")
            paths[name] = (path, checked)
    finally:
        model.train(was_training)
    return paths


def export_model(model: Transformer, out_dir: str | Path, opset: int = DEFAULT_OPSET, force: bool = False,
                 check_parity: bool = True, progress: Callable[[str], None] | None = None,
                 tokenizer: str | Path | None = None, parity_options: dict | None = None) -> Path:
    """Export an in-memory model to a bundle: graphs, validation, parity gate, manifest; atomic, all or nothing."""
    progress = progress or (lambda msg: None)
    check_opset(opset)
    with stage_bundle(out_dir, force) as tmp:
        graphs = export_graphs(model, tmp, opset, progress)
        paths = {name: path for name, (path, _) in graphs.items()}
        parity = None
        if check_parity:
            start = time.perf_counter()
            report = graph_parity(model, paths, provider="cpu", precision="fp32", **(parity_options or {}))
            progress(f"graph parity on onnxruntime cpu in {time.perf_counter() - start:.1f} s")
            if not report.ok:
                raise ParityError(f"{report.summary()}; nothing was written to {out_dir}", report)
            parity = report.to_dict()
        shared = share_weights(paths)      # weights.data: the embedding once for both graphs (same bytes: parity holds)
        if shared is not None:
            progress(f"weights in {shared['file']} ({shared['bytes'] / 1e6:.1f} MB), "
                     f"{shared_bytes(shared) / 1e6:.1f} MB of them stored once for both graphs")
        manifest = build_manifest(
            model.config.to_dict(), {name: graph_entry(path, checked) for name, (path, checked) in graphs.items()},
            precision="fp32", target="any", opset=opset, parity=parity, tokenizer=copy_tokenizer(tokenizer, tmp),
            decoder_layout=S.DYNAMIC)
        if shared is not None:
            manifest["shared_weights"] = shared
        write_manifest(tmp, manifest)
        progress(f"wrote manifest.json; moving bundle into place at {out_dir}")
    return Path(out_dir)


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, opset: int = DEFAULT_OPSET, force: bool = False,
                      check_parity: bool = True, progress: Callable[[str], None] | None = None,
                      parity_options: dict | None = None) -> Path:
    """Load a checkpoint and export it to a bundle (see export_model); bad input fails before any work."""
    check_opset(opset)
    check_destination(out_dir, force)
    ckpt = load_checkpoint(checkpoint_dir)
    (progress or (lambda msg: None))(f"loaded checkpoint {checkpoint_dir}: {ckpt.model.num_parameters():,} parameters")
    tokenizer = ckpt.path / TOKENIZER if ckpt.tokenizer is not None else None
    return export_model(ckpt.model, out_dir, opset, force, check_parity, progress, tokenizer, parity_options)
