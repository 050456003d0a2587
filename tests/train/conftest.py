"""The training fixtures of tests/runtime (the corpus), for the pipeline stage's tests."""

from tests.runtime.conftest import corpus_data  # noqa: F401
