"""Hugging Face M2M100 (M2M100ForConditionalGeneration: M2M100 and NLLB-200) -> the reference model.

Pre-norm layers with a final LayerNorm after each stack, embeddings scaled by sqrt(d) (scale_embedding), no
embedding LayerNorm, no logits bias, and fairseq's sinusoids: sin | cos halves with frequencies spaced
1/(half-1), position p reading row p + pad_id + 1 (bart.fairseq_table computes them: they are not in the
weights). Decoding starts from eos; the target language is forced as the first token (forced_bos_token_id),
and NLLB frames sources as `[src_lang] tokens </s>`.

One difference the reference model does not share: M2M100 gives a pad token *inside* a sequence the pad row
(zeros) and does not count it. Source padding here is always on the right and masked, so it changes no output;
a generated pad (trained models do not emit one) would be positioned differently. Conversion: bart.convert.
"""

from __future__ import annotations

from toolkit.reference.importers.bart import Architecture, family
from toolkit.reference.importers.registry import register_family

M2M100 = Architecture("m2m_100", "M2M100ForConditionalGeneration", "pre", "fairseq", False, False)

FAMILY = register_family(family(M2M100, "m2m100", "an M2M100 or NLLB-200 save_pretrained directory or hub name"))

__all__ = ["FAMILY", "M2M100"]
