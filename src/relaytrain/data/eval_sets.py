"""Named evaluation sets: what a run evaluates, each set under its own name.

A run evaluates its own held-out split (named "heldout", unless it is empty, as in a mix indexed
without --heldout) and each entry `name: path` of `eval.sets`: the held-out split of another
data directory, e.g. one of OLMo-core's validation sets indexed with `data index --heldout` or
text prepared with `data prepare --heldout-frac 1`. Every set must share the training data's
tokenizer (vocabulary, EOS and, where both are prepared text, the tokenizer file); the instances
of a set evaluated are fixed (`heldout_ids`), so every evaluation of every run on it sees the
same ones.
"""

from __future__ import annotations

import os
from typing import Any

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.order import heldout_ids
from relaytrain.errors import DataError

OWN_EVAL_SET = "heldout"  # the run's own held-out split, among the evaluation sets


def open_eval_sets(dataset: TokenDataset, sets: dict[str, str]) -> dict[str, Any]:
    """name -> held-out split: the run's own (unless empty), then `sets` in their order."""
    out: dict[str, Any] = {}
    own = dataset.split("heldout")
    if own.num_tokens > 0:
        out[OWN_EVAL_SET] = own
    for name, path in sets.items():
        ds = open_eval_set(name, path)
        theirs, ours = _tokenizer(ds), _tokenizer(dataset)
        if theirs[:2] != ours[:2] or (None not in (theirs[2], ours[2]) and theirs != ours):
            raise DataError(f"eval set '{name}' ({path}): its tokenizer ({_text(theirs)}) is "
                            f"not the training data's ({_text(ours)}); prepare or index it with "
                            "the training data's tokenizer")
        out[name] = ds.split("heldout")
    return out


def _tokenizer(ds: TokenDataset) -> tuple[int, int, str | None]:
    """What identifies a data directory's tokenizer: vocabulary, EOS and (prepared data only:
    token arrays record no file) the tokenizer file's sha256."""
    return ds.vocab_size, ds.eos_id, getattr(ds, "tokenizer_sha256", None)


def _text(tok: tuple[int, int, str | None]) -> str:
    return f"{tok[0]} ids, EOS {tok[1]}" + (f", sha256 {tok[2][:12]}" if tok[2] else "")


def open_eval_set(name: str, path: str) -> TokenDataset:
    try:
        ds = TokenDataset.open(path)
    except DataError as e:
        raise DataError(f"eval set '{name}': {e}") from None
    if ds.split("heldout").num_tokens == 0:
        raise DataError(f"eval set '{name}' ({path}): its held-out split is empty; index "
                        "the set with `data index --heldout FILE...` or prepare it with "
                        "`data prepare --heldout-frac 1`")
    return ds


def eval_ids(splits: dict[str, Any], seq_len: int, count: int) -> dict[str, list[int]]:
    """The instances evaluated each time, per set."""
    if not splits:
        raise DataError("nothing to evaluate: the data has no held-out split and eval.sets is "
                        "empty; prepare with --heldout-frac > 0, index with --heldout, name "
                        "sets in eval.sets, or set eval.every=0")
    out = {}
    for name, split in splits.items():
        n = split.num_instances(seq_len)
        if n < 1:
            where = "the run's held-out split" if name == OWN_EVAL_SET else f"eval set '{name}'"
            raise DataError(f"{where} has no instance of data.seq_len={seq_len} tokens; use a "
                            "shorter data.seq_len or a larger set")
        out[name] = [int(i) for i in heldout_ids(n, count)]
    return out


def absolute_paths(sets: dict[str, str]) -> dict[str, str]:
    """eval.sets with absolute paths, as the ledger header records them for the audit."""
    return {name: path if "://" in path else os.path.abspath(path)
            for name, path in sets.items()}
