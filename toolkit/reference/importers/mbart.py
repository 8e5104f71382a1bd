"""Hugging Face mBART (MBartForConditionalGeneration: mbart-large-cc25, mbart-large-50) -> the reference model.

BART with pre-norm layers and a final LayerNorm after each stack, beside BART's embedding LayerNorm and learned
positions (offset 2). mbart-large-50 starts decoding from eos and forces the target language as the first token
(generation's forced_bos_token_id); cc25 frames sources as `tokens </s> [src_lang]`. Conversion: bart.convert.
"""

from __future__ import annotations

from toolkit.reference.importers.bart import Architecture, family
from toolkit.reference.importers.registry import register_family

MBART = Architecture("mbart", "MBartForConditionalGeneration", "pre", "learned", True, True)

FAMILY = register_family(family(MBART, "mbart", "an mBART (cc25 or 50) save_pretrained directory or hub name"))

__all__ = ["FAMILY", "MBART"]
