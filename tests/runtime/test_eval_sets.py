"""Named evaluation sets in a run: each evaluated, recorded, plotted and alarmed under its own
name, `relaytrain eval` giving the run's numbers, and the audit checking each for
contamination."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.runlog import read_metrics
from relaytrain.runtime.controller import Controller
from relaytrain.train.plot import eval_curves
from tests.runtime.conftest import WORDS, records, tiny_config


def _eval_set(root: Path, data: str, sources: str) -> str:
    """`sources` prepared with the run's tokenizer, every document held out."""
    out = root / "set"
    assert main(["data", "prepare", "--source", sources, "--tokenizer",
                 str(Path(data) / "tokenizer.json"), "--heldout-frac", "1", "--out",
                 str(out)]) == 0
    return str(out)


@pytest.fixture
def clean_set(tmp_path: Path, corpus_data: str) -> str:
    """Word salad the run never trains on (other random draws of the same words)."""
    src = tmp_path / "clean-src"
    src.mkdir()
    for i in range(12):
        r = random.Random(1000 + i)
        (src / f"{i}.txt").write_text("\n".join(" ".join(r.choice(WORDS) for _ in range(12))
                                                for _ in range(40)) + "\n")
    return _eval_set(tmp_path / "clean", corpus_data, str(src / "*.txt"))


@pytest.fixture
def leaked_set(tmp_path: Path, corpus_data: str) -> str:
    """The training corpus itself: every training document is in it."""
    return _eval_set(tmp_path / "leak", corpus_data,
                     str(Path(corpus_data).parent / "corpus" / "*.txt"))


def test_each_named_set_is_evaluated_recorded_plotted_alarmed_and_audited_under_its_name(
        tmp_path, corpus_data, clean_set, leaked_set, capsys):
    run = tmp_path / "run"
    # A negative gap makes every set's memorisation alarm fire at every evaluation.
    Controller(tiny_config(run, corpus_data, "train.max_steps=8", "eval.every=4",
                           "checkpoint.every=4", f"eval.sets.clean={clean_set}",
                           f"eval.sets.leak={leaked_set}", "eval.memo_gap=-100")).run()
    evals = records(run, "eval")
    assert [e["step"] for e in evals] == [4, 8]
    assert all(list(e["sets"]) == ["heldout", "clean", "leak"] for e in evals)
    assert all(e["heldout_loss"] == e["sets"]["heldout"] for e in evals)
    last = evals[-1]["sets"]
    assert len(set(last.values())) == 3  # three different sets, three different losses
    # The leaked set is the training text: the model has seen it, the clean one it has not.
    assert last["leak"] < last["clean"]

    alarms = records(run, "alarm")
    assert sorted({a["set"] for a in alarms}) == ["clean", "heldout", "leak"]
    assert all(a["message"].startswith(f"eval set '{a['set']}': MEMORISATION ALARM")
               for a in alarms if a["set"] != "heldout")

    assert [label for label, _ in eval_curves(read_metrics(str(run)).evals)] == [
        "held-out loss", "eval set clean", "eval set leak"]
    assert main(["plot", str(run)]) == 0

    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {name: s["loss"] for name, s in out["sets"].items()} == last  # to the bit

    assert main(["data", "audit", str(run), "--json"]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    failed = {name for name, r in report["results"].items() if not r["ok"]}
    assert failed == {"heldout_documents:leak", "heldout_ngrams:leak"}
    assert {"heldout_documents:clean", "heldout_ngrams:clean"} <= set(report["results"])
    # The sampled fraction is stated per set.
    assert report["eval_ngrams"]["clean"]["sampled"] > 0
    assert report["eval_ngrams"]["leak"]["overlap"] > 0.8  # all but the run's own held-out
    assert "of 256 sampled held-out 32-grams" in report["results"]["heldout_ngrams:clean"][
        "detail"]


def test_a_set_with_another_tokenizer_is_refused_before_training(tmp_path, corpus_data, capsys):
    """The same vocabulary size and EOS, but BPE merges learnt from other text."""
    other = tmp_path / "other"
    assert main(["data", "prepare", "--source",
                 str(Path(corpus_data).parent / "corpus" / "doc0[0-3]*.txt"), "--tokenizer",
                 "bpe:320", "--heldout-frac", "0.5", "--out", str(other)]) == 0
    capsys.readouterr()
    code = main(["train", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                 f"data.path={corpus_data}", f"eval.sets.other={other}", "log.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert re.search(r"eval set 'other' .*: its tokenizer \(320 ids, EOS 0, sha256 \w+\) is "
                     r"not the training data's \(320 ids, EOS 0, sha256 \w+\)", err[0]), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_evaluation_set_needs_the_training_datas_tokenizer_file(tmp_path, corpus_data, capsys):
    """Every document held out leaves no text to train a BPE on."""
    code = main(["data", "prepare", "--source", str(Path(corpus_data).parent / "corpus" / "*"),
                 "--tokenizer", "bpe:320", "--heldout-frac", "1", "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "--heldout-frac 1" in err[-1] and "--tokenizer FILE" in err[-1], err
    assert not (tmp_path / "s").exists()
