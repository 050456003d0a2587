"""The training fixtures of tests/runtime (corpus, Ray cluster), for the pipeline tests."""

from tests.runtime.conftest import corpus_data, ray_cluster  # noqa: F401
