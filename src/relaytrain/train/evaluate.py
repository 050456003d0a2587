"""Held-out evaluation: the per-instance loss used during training and by `relaytrain eval`."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.eval_sets import open_eval_sets
from relaytrain.errors import UserError
from relaytrain.model.loss import lm_loss
from relaytrain.train.step import autocast_for


def heldout_losses(model: nn.Module, split: Any, ids: list[int], seq_len: int, micro_batch: int,
                   device: torch.device, dp_rank: int = 0, dp: int = 1) -> dict[int, float]:
    """Mean cross-entropy of each held-out instance this rank evaluates.

    `ids` is cut into micro-batch-sized chunks by position and the chunks are dealt to the DP
    ranks, so every instance is computed in the same batch whatever the world size.
    """
    out: dict[int, float] = {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for chunk in eval_chunks(ids, micro_batch, dp_rank, dp):
            tokens = torch.from_numpy(split.instances(chunk, seq_len)).to(device)
            with autocast_for(device):
                logits = model(tokens[:, :-1])
            out.update(instance_losses(logits, tokens, chunk))
    model.train(was_training)
    return out


def eval_chunks(ids: list[int], micro_batch: int, dp_rank: int, dp: int) -> list[list[int]]:
    """This DP rank's micro-batch-sized chunks of `ids` (cut by position, dealt round-robin)."""
    chunks = [ids[i: i + micro_batch] for i in range(0, len(ids), micro_batch)]
    return chunks[dp_rank::dp]


def instance_losses(logits: torch.Tensor, tokens: torch.Tensor, chunk: list[int]
                    ) -> dict[int, float]:
    """Mean cross-entropy of each instance of a chunk from its logits and tokens [n, T+1]."""
    out = {}
    for j, iid in enumerate(chunk):
        _, ce, _ = lm_loss(logits[j: j + 1], tokens[j: j + 1, 1:], 0.0)
        out[int(iid)] = float(ce)
    return out


def mean_loss(losses: dict[int, float], ids: list[int]) -> float:
    """Mean over `ids` in their order (a fixed summation order: reproducible to the bit)."""
    return math.fsum(losses[i] for i in ids) / len(ids)


# (split, ids, part, parts) -> per-instance held-out losses of chunk share `part` of `parts`
Forward = Callable[[Any, list[int], int, int], dict[int, float]]


class Evaluator:
    """A worker's held-out evaluation: its eval sets, opened at the first evaluation (not at
    every worker's start), and per set the losses of its share of the instances asked for,
    computed by `forward` (the path its steps take: the local model, or the pipeline)."""

    def __init__(self, dataset: TokenDataset, sets: dict[str, Any]):
        self.dataset, self.sets = dataset, sets
        self._splits: dict[str, Any] | None = None

    def losses(self, ids: dict[str, list[int]], forward: Forward, part: int, parts: int
               ) -> dict[str, dict[int, float]]:
        if self._splits is None:
            self._splits = open_eval_sets(self.dataset, self.sets)
        return {name: forward(self._splits[name], i, part, parts) for name, i in ids.items()}


def evaluate_checkpoint(target: str, data_path: str | None = None) -> dict[str, Any]:
    """A checkpoint's loss on its run's held-out split and evaluation sets, executed as the run
    was. `data_path` defaults to the run's; the first of "sets" is the run's own split."""
    from relaytrain.checkpoint.keys import model_tensors
    from relaytrain.checkpoint.store import open_checkpoint
    from relaytrain.config import config_from_dict
    from relaytrain.config.sections import ModelSection
    from relaytrain.data.eval_sets import eval_ids
    from relaytrain.model.config import Olmo3Config
    from relaytrain.model.olmo3 import Olmo3
    from relaytrain.train.execution import pick_device, prepare_model

    manifest, tensors = open_checkpoint(target)
    saved = manifest.get("config")
    cfg = config_from_dict(saved) if saved else None
    data_path = data_path or (cfg.data.path if cfg else None)
    if not data_path:
        raise UserError(f"checkpoint {target!r} records no data path; pass --data DIR "
                        "(a directory written by `relaytrain data prepare`)")
    if not os.path.isdir(data_path):
        raise UserError(f"data path {data_path!r} does not exist; pass --data DIR")
    dataset = TokenDataset.open(data_path)
    model_cfg = Olmo3Config.from_dict(manifest["model"])
    if model_cfg.tokenizer_vocab not in (None, dataset.vocab_size):
        raise UserError(f"data {data_path!r} has a tokenizer of {dataset.vocab_size} tokens but "
                        f"the checkpoint's model expects {model_cfg.tokenizer_vocab}")
    seq_len = cfg.seq_len if cfg else model_cfg.max_seq_len
    count = cfg.eval.instances if cfg else 32
    micro = cfg.train.micro_batch if cfg else 4
    splits = open_eval_sets(dataset, cfg.eval.sets if cfg else {})
    ids = eval_ids(splits, seq_len, count)
    device = pick_device("auto")
    model = Olmo3(model_cfg)
    model.load_state_dict(model_tensors(tensors))
    # Executed as the run was (its GEMM backend above all), so the loss is the run's to the bit.
    model = prepare_model(model, cfg.model if cfg else ModelSection(), device)
    sets = {}
    for name, split in splits.items():
        loss = mean_loss(heldout_losses(model, split, ids[name], seq_len, micro, device),
                         ids[name])
        sets[name] = {"loss": loss, "ppl": math.exp(min(loss, 50.0)),
                      "instances": len(ids[name])}
    first = next(iter(sets.values()))  # the run's own held-out split when it has one
    return {"checkpoint_step": manifest["step"], "heldout_loss": first["loss"],
            "heldout_ppl": first["ppl"], "instances": first["instances"],
            "seq_len": seq_len, "sets": sets}
