"""The training fixtures of tests/runtime (the corpus, the packed mix), for the pipeline
stage's tests."""

from tests.runtime.conftest import corpus_data, packed_mix  # noqa: F401
