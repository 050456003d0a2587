"""relaytrain: reproducible, elastic, pipeline-parallel pre-training of Olmo 3 models."""

__version__ = "0.1.0"
