"""Models as ordered lists of layers (any contiguous slice is a stage): the GPT, transformers' models, users'
factories, pretrained weights in and out. Imports io, pipeline (ties), config and errors."""

from pipedream2bw.models.factory import ModelSource, model_source
from pipedream2bw.models.gpt import build_gpt_layers, lm_loss

__all__ = ["build_gpt_layers", "lm_loss", "ModelSource", "model_source"]
