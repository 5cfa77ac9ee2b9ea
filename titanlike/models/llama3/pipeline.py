"""Pipeline split rule for the Llama 3 Transformer (ModelSpec.pipeline_stage)."""

from __future__ import annotations

import copy

from titanlike.models.llama3.model import Transformer


def pipeline_stage(model: Transformer, layer_keys: list[str], *, first: bool, last: bool) -> Transformer:
    """A copy of the (meta) model holding only layers `layer_keys`, the embedding if first and
    the final norm and output projection if last.

    The copy keeps the module tree and its keys, so every parameter keeps its full-model
    name and init_weights (seeded per name) gives it the value it has in the full model.
    Tied embeddings would need the first and last stages' copies kept equal; they are
    refused by config validation instead.
    """
    if model.model_args.tie_word_embeddings and not (first and last):
        raise ValueError("a pipeline stage cannot hold one end of tied embeddings")
    stage = copy.deepcopy(model)
    keep = set(layer_keys)
    for key in list(stage.layers.keys()):
        if key not in keep:
            del stage.layers[key]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


__all__ = ["pipeline_stage"]
