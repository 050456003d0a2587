"""What a run evaluates: its own held-out split and the named sets of `eval.sets`, each the
held-out split of a data directory sharing the training data's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.config import load_config
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.eval_sets import eval_ids, open_eval_sets
from relaytrain.errors import ConfigError, DataError
from tests.data.conftest import EOS, write_tokens

VOCAB = 100_278


def _index(out: Path, *args: str, vocab: int = VOCAB) -> Path:
    assert main(["data", "index", *args, "--vocab-size", str(vocab), "--eos-id", str(EOS),
                 "--out", str(out)]) == 0
    return out


@pytest.fixture()
def arrays(tmp_path: Path) -> dict[str, Path]:
    files = {"train": 900, "val-a": 300, "val-b": 100}
    for i, (name, n) in enumerate(files.items()):
        write_tokens(tmp_path / f"{name}.npy", n, seed=i)
    return {name: tmp_path / f"{name}.npy" for name in files}


def test_held_out_files_alone_index_an_evaluation_set(tmp_path, arrays):
    """A mix indexed without --heldout evaluates only its named sets, in their order, each on
    fixed evenly spaced instances."""
    train = TokenDataset.open(_index(tmp_path / "train", "--files", str(arrays["train"])))
    a = _index(tmp_path / "a", "--heldout", str(arrays["val-a"]))
    b = _index(tmp_path / "b", "--heldout", str(arrays["val-b"]))
    assert TokenDataset.open(a).split("train").num_tokens == 0
    splits = open_eval_sets(train, {"val-b": str(b), "val-a": str(a)})
    assert list(splits) == ["val-b", "val-a"]  # no own held-out split: not evaluated
    ids = eval_ids(splits, 16, 4)
    assert ids == {"val-b": [0, 1, 3, 4], "val-a": [0, 4, 9, 13]}  # 6 and 18 instances
    with pytest.raises(DataError, match="nothing to evaluate"):
        eval_ids(open_eval_sets(train, {}), 16, 4)


def test_sets_that_cannot_be_evaluated_are_refused_naming_the_set(tmp_path, arrays):
    train = TokenDataset.open(_index(tmp_path / "train", "--files", str(arrays["train"])))
    other = _index(tmp_path / "other", "--heldout", str(arrays["val-a"]), vocab=100_352)
    with pytest.raises(DataError, match=r"eval set 'x' .*: its tokenizer \(100352 ids, EOS "
                                        r"100257\) is not the training data's \(100278 ids, "
                                        r"EOS 100257\)"):
        open_eval_sets(train, {"x": str(other)})
    no_heldout = _index(tmp_path / "plain", "--files", str(arrays["val-a"]))
    with pytest.raises(DataError, match="eval set 'y' .*: its held-out split is empty"):
        open_eval_sets(train, {"y": str(no_heldout)})
    with pytest.raises(DataError, match="eval set 'z': data dir .*missing.* does not exist"):
        open_eval_sets(train, {"z": str(tmp_path / "missing")})
    short = open_eval_sets(train, {"s": str(_index(tmp_path / "s", "--heldout",
                                                   str(arrays["val-b"])))})
    with pytest.raises(DataError, match="eval set 's' has no instance of data.seq_len=128"):
        eval_ids(short, 128, 4)


@pytest.mark.parametrize("key", ["heldout", "a.b", "two words", "-x"])
def test_a_set_name_must_be_a_plain_word_other_than_the_runs_own(key):
    with pytest.raises(ConfigError, match="config key 'eval.sets': set name"):
        load_config("configs/tiny.yaml", [], base={"eval": {"sets": {key: "data/x"}}})


def test_index_without_any_files_is_refused(tmp_path, capsys):
    code = main(["data", "index", "--vocab-size", str(VOCAB), "--eos-id", str(EOS), "--out",
                 str(tmp_path / "none")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "no files given" in err[-1] and "--heldout" in err[-1], err
    assert not (tmp_path / "none").exists()
