"""What the exporter records for debugging that a deployed graph need not carry (the exported bundle keeps it all):
each node's Python stack trace (files on the exporting machine), its FX node's text and its module class path (both
said again by 'namespace'), and the ExportedProgram's signature (every parameter listed once more).

'namespace' and 'pkg.torch.onnx.name_scopes' stay: module names for whoever reads the graph, and T5's fp16
conversion of an fp32 bundle finds its FFN output projections by them (exporters/precision.fp16_keep_float).
"""

from __future__ import annotations

import onnx_ir as ir

NODE_DEBUG = ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node", "pkg.torch.onnx.class_hierarchy")
GRAPH_DEBUG = ("pkg.torch.export.ExportedProgram.graph_signature", "pkg.torch.export.ExportedProgram.range_constraints")


def drop_export_debug(model: ir.Model) -> None:
    """An optimized graph ships without NODE_DEBUG and GRAPH_DEBUG: the stack traces were the largest part of the
    small graphs' bytes, the rest 0.15 MB of flan-t5-base's int8 graphs (RESULTS.md, "T5 against its peers")."""
    for node in model.graph.all_nodes():
        for key in NODE_DEBUG:
            node.metadata_props.pop(key, None)
    for key in GRAPH_DEBUG:
        model.graph.metadata_props.pop(key, None)
        model.metadata_props.pop(key, None)
