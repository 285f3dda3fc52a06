"""PipeDream-2BW: pipeline-parallel training with double-buffered weights and 1F1B without flushes."""

__version__ = "0.1.0"
