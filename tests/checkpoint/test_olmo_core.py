"""An OLMo-core checkpoint read as ours, held against ai2-olmo-core itself: the reference
(tests/checkpoint/olmo_core_reference.py) is OLMo-core's own model, optimizer and checkpointer.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import pickle
import re
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relaytrain.checkpoint.keys import model_key, model_tensors, optim_key
from relaytrain.checkpoint.olmo_core import (
    DCP_DIR,
    OlmoCoreTrainerState,
    olmo_core_to_ours_name,
    read_olmo_core,
    read_olmo_core_metadata,
    read_olmo_core_trainer_state,
)
from relaytrain.config.sections import OptimSection
from relaytrain.errors import CheckpointError
from relaytrain.model.olmo3 import Olmo3
from relaytrain.train.optim import build_optimizer, load_optimizer_state

pytest.importorskip("olmo_core.nn.transformer")
from olmo_core.distributed.checkpoint import (  # noqa: E402
    load_model_and_optim_state,
    save_model_and_optim_state,
)
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from tests.checkpoint.olmo_core_reference import (  # noqa: E402
    BETAS,
    DIMENSIONS,
    LR,
    OURS,
    SEQ,
    STEPS,
    VOCAB,
    WD,
    Saved,
    assert_equal_to_olmo_core,
    counting_chunk_reads,
    olmo_core_model,
    olmo_core_step,
    save_olmo_core,
)

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return save_olmo_core(tmp_path_factory.mktemp("olmo_core"))


BLOCK_NAMES = {  # OLMo-core's (after blocks.N.) -> ours (after layers.N.), read off both codes
    "attention.w_q.weight": "attn.q_proj.weight", "attention.w_k.weight": "attn.k_proj.weight",
    "attention.w_v.weight": "attn.v_proj.weight", "attention.w_out.weight": "attn.o_proj.weight",
    "attention.q_norm.weight": "attn.q_norm.weight",
    "attention.k_norm.weight": "attn.k_norm.weight",
    "attention_norm.weight": "attn_norm.weight",  # on the attention's output (reordered norm)
    "feed_forward.w1.weight": "mlp.gate_proj.weight",  # w2(silu(w1 x) * w3 x)
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward_norm.weight": "mlp_norm.weight",
}


def test_olmo_cores_names_map_onto_ours(saved: Saved) -> None:
    for oc, ours in BLOCK_NAMES.items():
        assert olmo_core_to_ours_name(f"blocks.3.{oc}") == f"layers.3.{ours}"
    assert [olmo_core_to_ours_name(n) for n in
            ("embeddings.weight", "lm_head.norm.weight", "lm_head.w_out.weight")] == [
        "embed.weight", "norm.weight", "lm_head.weight"]
    with torch.device("meta"):
        ours = {n: p.shape for n, p in Olmo3(OURS).named_parameters()}
    assert {olmo_core_to_ours_name(n): p.shape for n, p in saved.model.named_parameters()} == ours


def test_weights_moments_and_step_equal_olmo_cores_to_the_bit(saved: Saved) -> None:
    c = read_olmo_core(str(saved.step_dir), optimizer=True)
    assert_equal_to_olmo_core(c.tensors, saved, optimizer=True)
    assert c.step == STEPS
    assert c.model == DIMENSIONS
    metadata = (saved.step_dir / DCP_DIR / ".metadata").read_bytes()
    assert c.digest == "sha256:" + hashlib.sha256(metadata).hexdigest()
    assert "AdamW moments at step 2" in c.what


def test_weights_only_from_the_dcp_directory_itself(saved: Saved) -> None:
    c = read_olmo_core(str(saved.step_dir / DCP_DIR), optimizer=False)
    assert_equal_to_olmo_core(c.tensors, saved, optimizer=False)
    assert c.step is None and c.model == DIMENSIONS


def test_the_metadata_alone_says_what_a_read_gives(saved: Saved, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What init.from checks a source by, before a run writes anything: every tensor's shape,
    the dimensions, the step count and the digest, from `.metadata` and one scalar's read."""
    c = read_olmo_core(str(saved.step_dir), optimizer=True)
    reads = counting_chunk_reads(monkeypatch)
    meta = read_olmo_core_metadata(str(saved.step_dir), optimizer=True)
    assert len(reads) == 1  # the step count
    assert meta.shapes == {k: tuple(t.shape) for k, t in c.tensors.items()}
    assert (meta.model, meta.step, meta.moments, meta.digest) == (DIMENSIONS, STEPS, True,
                                                                  c.digest)
    save_model_and_optim_state(tmp_path / "weights", saved.model)
    weights = read_olmo_core_metadata(str(tmp_path / "weights"))
    assert (weights.step, weights.moments) == (None, False)
    assert weights.shapes == {k: s for k, s in meta.shapes.items() if k.startswith("model.")}


def test_a_selective_read_reads_only_the_chunks_of_the_tensors_asked(
        saved: Saved, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = read_olmo_core(str(saved.step_dir), optimizer=True).tensors
    reads = counting_chunk_reads(monkeypatch)
    c = read_olmo_core(str(saved.step_dir), optimizer=True, keys=lambda k: ".layers.1." in k)
    want = {k: t for k, t in whole.items() if ".layers.1." in k}
    assert c.tensors.keys() == want.keys() and len(want) == 11 * 4
    assert all(torch.equal(c.tensors[k], t) for k, t in want.items())
    assert len(reads) == 1 + len(want)  # the step count, then one chunk each (unsharded)


def test_reads_an_fsspec_url(saved: Saved) -> None:
    fs = fsspec.filesystem("memory")
    fs.put(str(saved.step_dir), "/olmo_core/step2", recursive=True)
    try:
        # as the official scripts name AI2's: the step directory, with a trailing slash
        c = read_olmo_core("memory://olmo_core/step2/", optimizer=True)
    finally:
        fs.rm("/olmo_core", recursive=True)
    assert_equal_to_olmo_core(c.tensors, saved, optimizer=True)
    assert c.step == STEPS


class _Files(http.server.SimpleHTTPRequestHandler):
    """Serves a directory over HTTP, as olmo-checkpoints.org serves AI2's: byte ranges
    honoured (206), or, with `ranges` off, ignored (the whole file, 200)."""

    ranges = True

    def log_message(self, *args: Any) -> None:
        pass

    def send_head(self) -> io.BytesIO | None:
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return None
        data = path.read_bytes()
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if m and self.ranges:
            start, end = int(m[1]), int(m[2])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            data = data[start:end + 1]
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        return io.BytesIO(data)


@pytest.mark.parametrize("ranges", [True, False])
def test_reads_an_http_url(saved: Saved, ranges: bool) -> None:
    handler = type("Handler", (_Files,), {"ranges": ranges})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(saved.step_dir.parent)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/step2/"
    try:
        if not ranges:
            with pytest.raises(CheckpointError, match=r"cannot read the tensor at bytes \d+\.\.\d+ "
                                                      r"of __0_\d.distcp \(OSError: asked for "):
                read_olmo_core(url, optimizer=False)
            return
        c = read_olmo_core(url, optimizer=True)
    finally:
        server.shutdown()
        server.server_close()
    assert_equal_to_olmo_core(c.tensors, saved, optimizer=True)


def test_next_step_equals_olmo_cores_own(saved: Saved) -> None:
    """The checkpoint loaded into our Olmo3 and AdamW takes the step OLMo-core's own model and
    optimizer take from the same checkpoint and batch: the same loss, the same weights."""
    _, model, optim = olmo_core_model()
    load_model_and_optim_state(str(saved.step_dir / DCP_DIR), model, optim)
    want_loss = olmo_core_step(model, optim, saved.batch)

    c = read_olmo_core(str(saved.step_dir), optimizer=True)
    ours = Olmo3(OURS)
    ours.load_state_dict(model_tensors(c.tensors), strict=True)
    adamw = build_optimizer(ours, OptimSection(lr=LR, betas=BETAS, weight_decay=WD))
    load_optimizer_state(ours, adamw, c.tensors)
    assert len(adamw.state) == len(list(ours.parameters()))
    loss, _, _ = ours(saved.batch[:, :-1], labels=saved.batch[:, 1:])
    loss.backward()
    adamw.step()

    assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
    params = dict(ours.named_parameters())
    for name, p in model.named_parameters():
        q = params[olmo_core_to_ours_name(name)].detach()
        assert (q - p.detach()).abs().max() <= 1e-6 * p.detach().abs().max(), name


class _Runs:
    """A pickle that runs `fn(*args)` when loaded: what an allow-list must refuse."""

    def __init__(self, fn: Any, *args: Any):
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def copy_dcp(saved: Saved, tmp_path: Path) -> Path:
    dcp = tmp_path / "step2" / DCP_DIR
    shutil.copytree(saved.step_dir / DCP_DIR, dcp)
    return dcp


@pytest.mark.parametrize("payload", ["system", "eval"])
def test_a_forbidden_class_in_the_metadata_is_refused(saved: Saved, tmp_path: Path,
                                                      payload: str) -> None:
    dcp = copy_dcp(saved, tmp_path)
    marker = tmp_path / "ran"
    evil = (_Runs(os.system, f"touch {marker}") if payload == "system" else
            _Runs(eval, f"open({str(marker)!r}, 'w')"))
    (dcp / ".metadata").write_bytes(pickle.dumps(evil))
    with pytest.raises(CheckpointError, match=rf"refusing to unpickle \w+\.{payload}: not a "
                                              "class a torch distributed checkpoint"):
        read_olmo_core(str(dcp), optimizer=False)
    assert not marker.exists()


def test_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"is not an OLMo-core checkpoint: no .metadata in "
                                              r"it nor in its model_and_optim/ \(found: "
                                              r"notes.txt\); expected a torch distributed"):
        read_olmo_core(str(tmp_path), optimizer=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_olmo_core(str(tmp_path / "missing"), optimizer=False)


def test_a_corrupt_metadata_file_is_refused(saved: Saved, tmp_path: Path) -> None:
    dcp = copy_dcp(saved, tmp_path)
    metadata = dcp / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="is not a readable torch distributed checkpoint "
                                              "metadata file"):
        read_olmo_core(str(dcp), optimizer=False)
    metadata.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointError, match="is not a torch distributed checkpoint's "
                                              "metadata: it holds a dict, not a Metadata"):
        read_olmo_core(str(dcp), optimizer=False)
    # a chunk said to lie outside the directory (read by torch's own reader: trusted here)
    md = FileSystemReader(str(saved.step_dir / DCP_DIR)).read_metadata()
    next(iter(md.storage_data.values())).relative_path = "../../outside.distcp"
    metadata.write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"storage entry .* is not a file of the "
                                              "directory and a range"):
        read_olmo_core(str(dcp), optimizer=False)


def rewrite_metadata(dcp: Path, drop: str | None = None, add: str | None = None) -> None:
    """The metadata (read by torch's own reader: the test trusts it) with one entry dropped or
    one added."""
    md = FileSystemReader(str(dcp)).read_metadata()
    key = next(k for k in md.storage_data if k.fqn == "model.embeddings.weight")
    if drop is not None:
        del md.storage_data[next(k for k in md.storage_data if k.fqn == drop)]
    if add is not None:
        md.storage_data[MetadataIndex(add, key.offset)] = md.storage_data[key]
        md.state_dict_metadata[add] = md.state_dict_metadata[key.fqn]
    (dcp / ".metadata").write_bytes(pickle.dumps(md))


def test_missing_parameters_are_refused(saved: Saved, tmp_path: Path) -> None:
    dcp = copy_dcp(saved, tmp_path)
    rewrite_metadata(dcp, drop="model.blocks.1.feed_forward.w2.weight")
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\) of an Olmo 3 of 4 blocks, "
                                              r"e.g. 'model.blocks.1.feed_forward.w2.weight'"):
        read_olmo_core(str(dcp), optimizer=False)

    weights_only = tmp_path / "weights"
    save_model_and_optim_state(weights_only, saved.model)
    with pytest.raises(CheckpointError, match="holds no optimizer state: use init.optimizer: "
                                              "false"):
        read_olmo_core(str(weights_only), optimizer=True)
    assert read_olmo_core(str(weights_only), optimizer=False).step is None


def test_a_parameter_olmo3_does_not_have_is_refused(saved: Saved, tmp_path: Path) -> None:
    dcp = copy_dcp(saved, tmp_path)
    rewrite_metadata(dcp, add="model.blocks.0.attention.w_q.bias")
    with pytest.raises(CheckpointError, match=r"holds 'blocks.0.attention.w_q.bias', not a "
                                              "parameter of an Olmo 3 transformer"):
        read_olmo_core(str(dcp), optimizer=False)


def _save_sharded(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: OLMo-core's model sharded by its own `apply_fsdp` (FSDP2), two
    steps, saved by its checkpointer (each rank its rows); rank 0 keeps the whole tensors."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    _, model, optim = olmo_core_model(shard=init_device_mesh("cpu", (2,)))
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        olmo_core_step(model, optim, torch.randint(0, VOCAB, (2, SEQ + 1), generator=g))
    save_model_and_optim_state(f"{out}/{DCP_DIR}", model, optim)
    whole = {}
    for name, p in model.named_parameters():
        ours = olmo_core_to_ours_name(name)
        whole[model_key(ours)] = p.full_tensor()
        for state, t in optim.state[p].items():
            whole[optim_key(ours, state)] = t.full_tensor() if isinstance(t, DTensor) else t
    if rank == 0:
        torch.save(whole, f"{out}/whole.pt")
    # Both ranks leave together: a rank that tears gloo down while its peer still holds the
    # pair aborts the peer ("terminate called without an active exception", seen once in CI).
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_sharded_save_is_read_whole(tmp_path: Path) -> None:
    """FSDP-sharded, as AI2's checkpoints are: each tensor's chunks, in the files of both ranks,
    assembled into the whole tensors OLMo-core's ranks held."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_save_sharded, args=(port, str(tmp_path)), nprocs=2)
    md = FileSystemReader(str(tmp_path / DCP_DIR)).read_metadata()
    assert len(md.state_dict_metadata["model.embeddings.weight"].chunks) == 2  # really sharded
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    c = read_olmo_core(str(tmp_path), optimizer=True)
    assert set(c.tensors) == set(whole) and c.step == STEPS
    for key, t in whole.items():
        assert torch.equal(c.tensors[key], t), key


# ---- the trainer state (train/rank0.pt) --------------------------------------------------------

def trainer_state(step: int = 7, **loader: Any) -> dict[str, Any]:
    """A trainer state as OLMo-core's Trainer.state_dict() builds it, its RNG states OLMo-core's
    own (numpy arrays, a torch tensor: objects the reader must not build)."""
    from olmo_core.train.utils import EnvRngStates

    return {"global_step": step, "global_train_tokens_seen": step * 2 * SEQ,
            "global_train_petaflops": 0.0, "max_steps": 10,
            "data_loader": {"dataset_fingerprint_version": "v2.0", "dataset_fingerprint": "ab",
                            "batches_processed": step, "tokens_processed": step * 2 * SEQ,
                            "seed": 34521, "epoch": 1, "dataset_type": "fsl",
                            "sequence_length": SEQ, "max_target_sequence_length": SEQ,
                            **loader},
            "epoch": 1, "world_size": 1, "rng": EnvRngStates.current_state().as_dict(),
            "callbacks": {"checkpointer": {}}}


def write_trainer_state(saved: Saved, tmp_path: Path, state: Any) -> Path:
    """`saved`'s step directory with `state` as its trainer state, as the Checkpointer writes
    it (`torch.save`)."""
    step_dir = tmp_path / "step7"
    shutil.copytree(saved.step_dir, step_dir)
    (step_dir / "train").mkdir()
    torch.save(state, step_dir / "train" / "rank0.pt")
    return step_dir


def test_the_trainer_state_gives_the_step_and_data_position_building_nothing_else(
        saved: Saved, tmp_path: Path) -> None:
    """The step count and the data loader's position are read; the RNG states (numpy, torch)
    and a payload that would run a command stand as inert placeholders: nothing runs."""
    marker = tmp_path / "ran"
    state = trainer_state(callbacks={"evil": _Runs(os.system, f"touch {marker}")})
    step_dir = write_trainer_state(saved, tmp_path, state)
    got = read_olmo_core_trainer_state(str(step_dir))
    digest = hashlib.sha256((step_dir / "train" / "rank0.pt").read_bytes()).hexdigest()
    assert got == OlmoCoreTrainerState(7, 1, 7 * 2 * SEQ, 7, 34521, f"sha256:{digest}")
    assert read_olmo_core_trainer_state(str(step_dir / DCP_DIR)) == got  # from the DCP too
    assert not marker.exists()
    assert read_olmo_core_trainer_state(str(saved.step_dir)) is None  # weights alone


@pytest.mark.parametrize(("state", "said"), [
    ([1, 2], "holds no OLMo-core trainer state"),
    (trainer_state(step=-1), "the trainer state's global_step is -1, not an integer >= 0"),
    (trainer_state(seed="34521"), "the trainer state's seed is '34521', not an integer"),
    (trainer_state(epoch=0, tokens_processed=None), "tokens_processed is None"),
])
def test_a_trainer_state_of_other_values_is_refused(saved: Saved, tmp_path: Path, state: Any,
                                                    said: str) -> None:
    step_dir = write_trainer_state(saved, tmp_path, state)
    with pytest.raises(CheckpointError, match=re.escape(said)):
        read_olmo_core_trainer_state(str(step_dir))
    (step_dir / "train" / "rank0.pt").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="is not a trainer state torch.save wrote"):
        read_olmo_core_trainer_state(str(step_dir))
