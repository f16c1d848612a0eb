"""fivefold: train decoder LLMs with data, tensor, pipeline, context and expert parallelism on one mesh."""

__version__ = "0.1.0"
