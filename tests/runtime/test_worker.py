"""The worker's restore from storage and its warm-up, through a real worker (its checkpoint
writes as the controller collects them: tests/checkpoint/test_checkpoint_writer.py; the rest of
the worker is exercised through real runs: test_train.py, test_elastic.py)."""

from __future__ import annotations

import pytest
import torch

from relaytrain.checkpoint.keys import model_key, optim_key
from relaytrain.data.dataset import TokenDataset
from relaytrain.parallel.groups import Placement
from relaytrain.runtime.controller import Controller
from relaytrain.runtime.worker import Worker
from tests.runtime.conftest import tiny_config

pytestmark = pytest.mark.timeout(30)


def test_a_restore_from_storage_lands_in_the_live_state_and_equals_the_checkpoint(
        tmp_path, corpus_data):
    """A worker that already holds a state (a survivor rolled back, a resume into a built
    model) reads a checkpoint straight into its parameters and optimizer moments: no fresh
    memory, no copy, and the values are the checkpoint's."""
    cfg = tiny_config(tmp_path, corpus_data, "runtime.engine=inline", "train.max_steps=4",
                      "checkpoint.every=2")
    Controller(cfg).run()
    w = Worker(cfg, TokenDataset.open(corpus_data).vocab_size)
    w.setup(0, Placement(rank=0, world=1, dp_rank=0, dp=1))
    w.build(4)
    w.run_steps(5, 1)  # the state now differs from any checkpoint
    live = {k: t.data_ptr() for k, t in w.state.state_tensors().items()}
    reads, read = [], w.state.store.read

    def spy(*args, **kwargs):
        manifest, tensors = read(*args, **kwargs)
        reads.append((kwargs.get("into"), tensors))
        return manifest, tensors
    w.state.store.read = spy
    w.build(2)
    (into, got), = reads
    _, saved = read(2)
    state = w.state.state_tensors()
    assert {k: t.data_ptr() for k, t in state.items()} == live
    assert all(got[k] is into[k] for k in state)  # read there, not copied there afterwards
    names = [n for n, _ in w.state.model.named_parameters()]
    assert state.keys() == {model_key(n) for n in names} | {
        optim_key(n, m) for n in names for m in ("exp_avg", "exp_avg_sq", "step")}
    for k, t in state.items():
        assert torch.equal(t, saved[k]), k


def test_a_warmed_up_worker_ran_its_kernels_at_the_runs_shape_and_kept_nothing_of_it(
        tmp_path, corpus_data, monkeypatch):
    """A spare or the standby builds its model and runs one forward and backward of a
    micro-batch of the run's shape (a process's first products build their kernels), leaving
    the seed's weights as they were and no gradients."""
    from relaytrain.model.init import init_weights
    from relaytrain.model.olmo3 import Olmo3

    cfg = tiny_config(tmp_path, corpus_data, "runtime.engine=inline", "train.micro_batch=3",
                      "train.global_batch=6", "data.seq_len=24")
    shapes, forward = [], Olmo3.forward

    def spy(self, tokens, *args, **kwargs):
        shapes.append(tuple(tokens.shape))
        return forward(self, tokens, *args, **kwargs)
    monkeypatch.setattr(Olmo3, "forward", spy)
    w = Worker(cfg, TokenDataset.open(corpus_data).vocab_size)
    w.warm_up()
    assert shapes == [(3, 24)]
    seeded = Olmo3(w.model_cfg)
    init_weights(seeded, cfg.seed)
    expected = dict(seeded.named_parameters())
    for name, p in w.state.model.named_parameters():
        assert p.grad is None, name
        assert torch.equal(p.detach(), expected[name].detach()), name


def _order_and_weights(tmp_path, corpus_data, *seeds: str) -> tuple[list, dict]:
    """The ids of the first two global batches a worker of that config trains on, and its
    initial weights."""
    cfg = tiny_config(tmp_path, corpus_data, "runtime.engine=inline", *seeds)
    w = Worker(cfg, TokenDataset.open(corpus_data).vocab_size)
    w.setup(0, Placement(rank=0, world=1, dp_rank=0, dp=1))
    w.build(0)
    ids = [w.loader.get(k).ids.tolist() for k in (0, 1)]
    weights = {n: p.detach().clone() for n, p in w.state.model.named_parameters()}
    w.close()
    return ids, weights


def test_data_seed_drives_the_order_alone_and_seed_the_initial_weights(tmp_path, corpus_data):
    """data.seed takes another run's data order with this run's initialisation; seed the
    reverse; no data.seed is the seed's order."""
    base_ids, base_w = _order_and_weights(tmp_path, corpus_data, "seed=3")
    same_ids, same_w = _order_and_weights(tmp_path, corpus_data, "seed=3", "data.seed=3")
    data_ids, data_w = _order_and_weights(tmp_path, corpus_data, "seed=3", "data.seed=34521")
    init_ids, init_w = _order_and_weights(tmp_path, corpus_data, "seed=4", "data.seed=3")
    assert same_ids == base_ids == init_ids and data_ids != base_ids
    for name, p in base_w.items():
        assert torch.equal(same_w[name], p) and torch.equal(data_w[name], p), name
    assert any(not torch.equal(init_w[name], p) for name, p in base_w.items())
