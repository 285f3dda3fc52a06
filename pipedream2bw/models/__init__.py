"""Models as ordered lists of layers: any contiguous slice of the list is a pipeline stage."""

from pipedream2bw.models.factory import ModelSource, model_source
from pipedream2bw.models.gpt import build_gpt_layers, lm_loss

__all__ = ["build_gpt_layers", "lm_loss", "ModelSource", "model_source"]
