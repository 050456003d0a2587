"""A worker's training state without a process group: restored from a peer's donation (its whole
snapshot, or pieces from several peers) it holds exactly the donor's tensors; its own snapshot
comes before storage; a module is reused only for the same layout after step 0."""

from __future__ import annotations

import pytest
import torch

from relaytrain.checkpoint.pieces import cut
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.config import load_config
from relaytrain.config.sections import RunConfig
from relaytrain.errors import CheckpointError
from relaytrain.parallel.reduce import GradReducer
from relaytrain.train.state import TrainState
from relaytrain.train.step import train_step

pytestmark = pytest.mark.timeout(30)
torch.set_num_threads(1)
WHOLE = (0, 1, 1)  # an unpipelined, unsharded layout
VOCAB = 64


def config(run_dir) -> RunConfig:
    return load_config("configs/tiny.yaml", [
        f"run_dir={run_dir}", "data.seq_len=8", "model.attention=sdpa", "model.matmul=aten",
        "model.kernels=torch", "model.compile=none"])


def state_of(cfg: RunConfig) -> TrainState:
    """A state whose checkpoints would be read from an empty directory (none exists)."""
    return TrainState(cfg, cfg.model_config(VOCAB), torch.device("cpu"),
                      CheckpointStore(str(cfg.checkpoint_url)))


def trained(cfg: RunConfig, steps: int) -> TrainState:
    """A state after `steps` real steps: weights off the seed's, AdamW's moments filled."""
    state = state_of(cfg)
    state.build(0, None, WHOLE)
    reducer = GradReducer(list(state.model.parameters()), None, exact=False,
                          total_micro_batches=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = [(m, torch.randint(0, VOCAB, (2, 9), generator=g)) for m in range(2)]
        train_step(state.model, state.optimizer, reducer, batch, 2, 0.0, 1.0, state.device)
    return state


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert torch.equal(got[k], t), k


def test_a_replacement_restored_from_a_peers_whole_snapshot_holds_the_peers_state(tmp_path):
    cfg = config(tmp_path)
    donor = trained(cfg, 2)
    donor.take_snapshot(2)
    replacement = state_of(cfg)
    replacement.build(2, donor.snapshot_tensors(2), WHOLE)
    assert any(k.startswith("optim.") for k in donor.state_tensors())
    assert_same(replacement.state_tensors(), donor.state_tensors())


def test_a_state_assembled_from_several_peers_pieces_is_theirs(tmp_path):
    """Pieces are what each peer's snapshot holds of the rows wanted: unsharded, whole tensors
    (`cut` with no rows), here half of the tensors from each of two peers."""
    cfg = config(tmp_path)
    donor = trained(cfg, 1)
    donor.take_snapshot(1)
    pieces = cut(donor.snapshot_tensors(1), {}, {})
    keys = sorted(pieces)
    given = [{k: pieces[k] for k in keys[::2]}, {k: pieces[k] for k in keys[1::2]}]
    replacement = state_of(cfg)
    replacement.build(1, given, WHOLE)
    assert_same(replacement.state_tensors(), donor.state_tensors())


def test_a_shard_takes_its_rows_of_a_whole_tensor_an_unsharded_peer_sent(tmp_path, monkeypatch):
    """A sharded run grown back from one (unsharded) worker: that peer's pieces are whole
    tensors, of which each new shard keeps only its rows."""
    cfg = config(tmp_path)
    donor = trained(cfg, 1)
    donor.take_snapshot(1)
    whole = donor.snapshot_tensors(1)
    pieces = cut(whole, {}, {})
    key = next(k for k, t in whole.items() if t.dim() == 2)
    monkeypatch.setattr(TrainState, "_own_rows", lambda self: {key: (2, 5)})
    got = state_of(cfg)._assembled([pieces])
    assert torch.equal(got[key], whole[key][2:5])
    assert all(torch.equal(got[k], t) for k, t in whole.items() if k != key)


def test_a_worker_restores_its_own_snapshot_before_looking_in_storage(tmp_path):
    cfg = config(tmp_path)
    state = trained(cfg, 1)
    state.take_snapshot(1)
    kept = {k: t.clone() for k, t in state.state_tensors().items()}
    module = state.model
    train_step(state.model, state.optimizer,
               GradReducer(list(state.model.parameters()), None, exact=False,
                           total_micro_batches=1),
               [(0, torch.randint(0, VOCAB, (2, 9)))], 1, 0.0, 1.0, state.device)
    state.build(1, None, WHOLE)  # storage holds no checkpoint: reading it would fail
    assert state.model is module  # the same layout after step 0: the module is kept
    assert_same(state.state_tensors(), kept)
    with pytest.raises(CheckpointError, match="never committed"):
        state.build(2, None, WHOLE)  # no snapshot of step 2: the checkpoint, which is missing


def test_a_module_is_new_at_step_0_and_for_another_layout(tmp_path):
    state = trained(config(tmp_path), 1)
    module = state.model
    state.build(0, None, WHOLE)
    assert state.model is not module
    fresh = state_of(config(tmp_path))
    fresh.build(0, None, WHOLE)
    assert_same(state.state_tensors(), fresh.state_tensors())  # the seed's, AdamW's empty
    module = state.model
    state.take_snapshot(1)
    state.build(1, state.snapshot_tensors(1), (0, 1, 2))  # another layout (not sharded here)
    assert state.model is not module and state.layout == (0, 1, 2)
