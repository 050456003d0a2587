"""The training fixtures of tests/runtime, for the pipeline tests."""

from tests.runtime.conftest import corpus_data  # noqa: F401
