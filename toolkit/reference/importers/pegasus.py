"""Hugging Face Pegasus (PegasusForConditionalGeneration) -> the reference model.

Pre-norm layers with a final LayerNorm after each stack, embeddings scaled by sqrt(d), Marian's sin | cos halves
sinusoids (checked equal to ours when the weights carry them), final_logits_bias, and decoding from pad (so pad
is never generated: suppress_pad, as in Marian). Conversion: bart.convert.
"""

from __future__ import annotations

from toolkit.reference.importers.bart import Architecture, family
from toolkit.reference.importers.registry import register_family

PEGASUS = Architecture("pegasus", "PegasusForConditionalGeneration", "pre", "halves", False, True)

FAMILY = register_family(family(PEGASUS, "pegasus", "a Pegasus save_pretrained directory or hub name"))

__all__ = ["FAMILY", "PEGASUS"]
