"""`auto` for a setting chosen for speed is measured on the host, once: cached per host key and
what was timed, measured again when the key changes, and never consulted when a backend is
given; here through `model.matmul` (the kernels and attention contests share the machinery:
`tests/train/test_auto_backends.py`)."""

import json

import pytest
import torch

import relaytrain.model.backend_choice as choice_module
from relaytrain.model.backend_choice import (
    MARGIN,
    Choice,
    cache_path,
    choose_matmul,
    keep_on_resume,
    measure,
    products,
)
from relaytrain.model.config import PRESETS
from relaytrain.model.matmul import onednn_available

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
TINY = PRESETS["tiny"].with_vocab(300)


@pytest.fixture
def timings(monkeypatch):
    """`measure` replaced by a stub returning `timings.ratio` (oneDNN / aten); its calls."""
    calls = []

    def fake(shapes, threads, rounds=4):
        calls.append((shapes, threads))
        return {"aten": 0.010, "onednn": 0.010 * fake.ratio}, fake.ratio

    fake.ratio = 0.5
    monkeypatch.setattr(choice_module, "measure", fake)
    monkeypatch.setattr(choice_module, "loaded", lambda: False)  # the suite loads the cores
    return fake, calls


def test_auto_measures_once_then_reads_the_cache(tmp_path, timings):
    fake, calls = timings
    cache = tmp_path / "backends.json"
    first = choose_matmul("auto", TINY, CPU, 2, key="cpu A", cache=cache)
    assert (first.backend, first.source) == ("onednn", "measured")
    assert first.times == {"aten": 0.010, "onednn": 0.005}
    assert calls == [(products(TINY), 2)]
    fake.ratio = 2.0  # would now pick aten, but the cache answers
    again = choose_matmul("auto", TINY, CPU, 2, key="cpu A", cache=cache)
    assert (again.backend, again.source, again.times["onednn"]) == ("onednn", "cached", 0.005)
    assert len(calls) == 1
    assert "cpu A" in next(iter(json.loads(cache.read_text())))


def test_a_measurement_on_a_loaded_host_is_kept_for_an_hour_then_measured_again(
        tmp_path, timings, monkeypatch):
    """Measured while other work competes for the cores, a choice says more about the load
    than the backends, so it is not kept for good; but until it expires every run on the host
    uses it, loaded or quiet, so two runs of one config do not differ by when they started."""
    fake, calls = timings
    cache = tmp_path / "backends.json"
    clock = [1000.0]
    monkeypatch.setattr(choice_module.time, "time", lambda: clock[0])
    monkeypatch.setattr(choice_module, "loaded", lambda: True)
    busy = choose_matmul("auto", TINY, CPU, 2, key="cpu A", cache=cache)
    assert (busy.backend, busy.source) == ("onednn", "measured on a loaded host")
    fake.ratio = 2.0  # a quiet host would now pick aten
    monkeypatch.setattr(choice_module, "loaded", lambda: False)
    clock[0] += choice_module.PROVISIONAL_S - 1
    kept = choose_matmul("auto", TINY, CPU, 2, key="cpu A", cache=cache)
    assert (kept.backend, kept.source) == ("onednn", "cached on a loaded host")
    assert len(calls) == 1
    clock[0] += 1
    quiet = choose_matmul("auto", TINY, CPU, 2, key="cpu A", cache=cache)
    assert (quiet.backend, quiet.source) == ("aten", "measured")
    clock[0] += 100 * choice_module.PROVISIONAL_S  # a quiet measurement is kept for good
    assert choose_matmul("auto", TINY, CPU, 2, key="cpu A", cache=cache).source == "cached"
    assert len(calls) == 2


@pytest.mark.parametrize("recorded,expected", [
    ({"backend": "onednn", "key": "cpu A"}, ("onednn", "resumed")),  # same host: the run's own
    ({"backend": "onednn", "key": "cpu B"}, ("aten", "measured")),  # another host measures
    ({"backend": "aten", "key": "cpu A"}, ("aten", "measured")),  # they agree
    (None, ("aten", "measured")),  # a checkpoint from before the choice was recorded
    ({"backend": "cublas", "key": "cpu A"}, ("aten", "measured")),
    ({"backend": "fused", "key": "cpu A"}, ("aten", "measured")),  # another setting's backend
])
def test_a_resumed_run_keeps_the_backend_auto_chose_for_it_on_the_same_host(recorded, expected):
    now = Choice("matmul", "aten", "measured", {"aten": 0.01, "onednn": 0.02}, "cpu A")
    kept = keep_on_resume(now, recorded)
    assert (kept.backend, kept.source) == expected
    assert kept.key == "cpu A"


def test_a_backend_given_by_the_config_is_kept_on_resume():
    given = Choice("matmul", "aten", "setting")
    assert keep_on_resume(given, {"backend": "onednn", "key": None}) is given


def test_the_host_key_names_the_processor_beyond_its_marketing_name():
    """Virtual machines show one generic name for different processors."""
    key = choice_module.host_key(2)
    if "family" not in key:
        pytest.skip("no /proc/cpuinfo model fields on this system")
    assert "model" in key and "stepping" in key and "2 threads" in key


def test_a_changed_host_key_or_model_is_measured_again(tmp_path, timings):
    fake, calls = timings
    cache = tmp_path / "backends.json"
    assert choose_matmul("auto", TINY, CPU, 2, key="cpu A", cache=cache).backend == "onednn"
    fake.ratio = 2.0
    on_b = choose_matmul("auto", TINY, CPU, 2, key="cpu B", cache=cache)
    assert (on_b.backend, on_b.source) == ("aten", "measured")
    wider = PRESETS["tiny"].with_vocab(5000)
    assert choose_matmul("auto", wider, CPU, 2, key="cpu A", cache=cache).source == "measured"
    assert len(calls) == 3
    assert choose_matmul("auto", TINY, CPU, 2, key="cpu A", cache=cache).backend == "onednn"
    assert len(calls) == 3  # every entry kept


def test_onednn_must_win_by_the_margin(tmp_path, timings):
    fake, _ = timings
    fake.ratio = (MARGIN + 1) / 2  # faster, but within the margin: aten, HF's exact path
    assert choose_matmul("auto", TINY, CPU, 2, key="k", cache=tmp_path / "c.json"
                         ).backend == "aten"


def test_a_given_backend_or_a_gpu_is_never_measured(tmp_path, timings):
    _, calls = timings
    cache = tmp_path / "backends.json"
    for setting in ("aten", "onednn"):
        c = choose_matmul(setting, TINY, CPU, 2, key="k", cache=cache)
        assert (c.backend, c.source) == (setting, "setting")
    assert choose_matmul("auto", TINY, CUDA, 2, key="k", cache=cache).backend == "aten"
    with pytest.raises(ValueError, match="matmul='blas'"):
        choose_matmul("blas", TINY, CPU, 2)
    assert calls == [] and not cache.exists()


def test_an_unreadable_cache_is_measured_over(tmp_path, timings):
    _, calls = timings
    cache = tmp_path / "backends.json"
    cache.write_text("{not json")
    assert choose_matmul("auto", TINY, CPU, 2, key="k", cache=cache).source == "measured"
    assert choose_matmul("auto", TINY, CPU, 2, key="k", cache=cache).source == "cached"
    assert len(calls) == 1
    for bad in ({"expires": "soon"}, {"source": None}, {"backend": "mkl"},  # edited by hand
                {"backend": "fused"}, {"times": [1, 2]}, {"times": {"aten": "fast"}}):
        entries = json.loads(cache.read_text())
        entries = {k: {**v, **bad} for k, v in entries.items()}
        cache.write_text(json.dumps(entries))
        assert choose_matmul("auto", TINY, CPU, 2, key="k", cache=cache).source == "measured"
    assert len(calls) == 7


def test_the_cache_lives_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path() == tmp_path / "relaytrain" / "backends.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_path() == tmp_path / ".cache" / "relaytrain" / "backends.json"


def test_the_measurement_times_both_backends_on_the_models_products():
    times, ratio = measure(products(TINY), threads=1, rounds=2)
    assert times.keys() == {"aten", "onednn"} and min(times.values()) > 0 and ratio > 0
    d, hidden = TINY.d_model, TINY.mlp_hidden
    assert {(d, hidden), (hidden, d), (d, TINY.vocab_size)} <= set(products(TINY))
