"""CheckpointStore: layout, round trip, commit marker, retention, verification, safe loading."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import uuid
import warnings

import fsspec
import pytest
import safetensors.torch
import torch
import xxhash
from fsspec.implementations.memory import MemoryFileSystem

import relaytrain.checkpoint.streaming as streaming
from relaytrain.checkpoint.store import CheckpointStore, CheckpointWarning, open_checkpoint
from relaytrain.errors import CheckpointError, UserError


def state(step: int) -> dict[str, torch.Tensor]:
    """A small model + optimizer state whose every value is the step number."""
    return {"model.embed.weight": torch.full((8, 4), float(step)),
            "optim.embed.weight.exp_avg": torch.full((8, 4), float(step)),
            "optim.embed.weight.step": torch.tensor(step, dtype=torch.int64)}


def save(store: CheckpointStore, step: int, **meta) -> None:
    t = state(step)
    parts = {"model": store.write_part(step, "model", {k: v for k, v in t.items()
                                                         if k.startswith("model.")}),
             "optim": store.write_part(step, "optim", {k: v for k, v in t.items()
                                                         if k.startswith("optim.")})}
    store.commit(step, parts, meta)


def assert_state(tensors: dict[str, torch.Tensor], step: int) -> None:
    expected = state(step)
    assert tensors.keys() == expected.keys()
    for k, v in expected.items():
        assert tensors[k].dtype == v.dtype and torch.equal(tensors[k], v), k


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so NaNs and exotic dtypes compare exactly."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def part_path(root, step: int, part: str) -> str:
    return os.path.join(root, f"step_{step:08d}", f"{part}.safetensors")


def flip_byte(path: str, offset_from_end: int = 3) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


# -- writing and reading -------------------------------------------------------------------


def test_round_trip_is_bit_exact_for_every_dtype_shape_and_layout(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    param = torch.nn.Parameter(torch.randn(5))
    tensors = {
        "f32": torch.tensor([1.5, float("nan"), -float("inf")]),
        "f64": torch.randn(2, 3, dtype=torch.float64),
        "f16": torch.randn(7, dtype=torch.float16),
        "bf16": torch.randn(3, 5, dtype=torch.bfloat16),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
        "c64": torch.randn(3, dtype=torch.complex64),
        "i64_step": torch.tensor(1234, dtype=torch.int64),
        "f32_step": torch.tensor(17.0),
        "i32": torch.tensor([-1, 2**31 - 1], dtype=torch.int32),
        "i16": torch.tensor([-7], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "u16": torch.tensor([65535], dtype=torch.uint16),
        "u32": torch.tensor([2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([2**63 + 5], dtype=torch.uint64),
        "bool": torch.tensor([[True, False], [False, True]]),
        "empty": torch.zeros(0, 3),
        "transposed": base.t(),  # non-contiguous
        "column": base[:, 1],  # strided view sharing base's storage
        "row": base[1],  # another view of the same storage
        "param": param,  # requires grad
    }
    store = CheckpointStore(str(tmp_path))
    store.commit(1, {"all": store.write_part(1, "all", tensors)}, {})
    _, back = store.read(1)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert torch.equal(bits(back[k]), bits(t)), k
        assert not back[k].requires_grad


def test_part_is_a_plain_safetensors_file_whose_record_matches_its_bytes(tmp_path):
    """Hashed in blocks: each block's XXH3-128, and the file's digest the XXH3-128 of theirs."""
    store = CheckpointStore(str(tmp_path), block_size=64)
    record = store.write_part(3, "model", state(3))
    path = part_path(tmp_path, 3, "model")
    data = open(path, "rb").read()
    blocks = [xxhash.xxh3_128(data[i:i + 64]).hexdigest() for i in range(0, len(data), 64)]
    assert len(blocks) > 2
    assert record == {"file": "model.safetensors", "size": len(data), "block_size": 64,
                      "blocks": blocks, "xxh3_128": xxhash.xxh3_128(
                          b"".join(bytes.fromhex(b) for b in blocks)).hexdigest()}
    loaded = safetensors.torch.load_file(path)  # the reference reader accepts it
    assert_state(loaded, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_written_from_a_cpu_copy(tmp_path):
    store = CheckpointStore(str(tmp_path))
    x = torch.arange(6.0, device="cuda").reshape(2, 3).t()
    store.commit(1, {"model": store.write_part(1, "model", {"x": x})}, {})
    back = store.read(1)[1]["x"]
    assert back.device.type == "cpu" and torch.equal(back, x.cpu())


def test_manifest_is_written_last_and_records_files_and_meta(tmp_path):
    store = CheckpointStore(str(tmp_path))
    record = store.write_part(5, "model", state(5))
    assert store.committed_steps() == []  # parts alone are not a checkpoint
    url = store.commit(5, {"model": record}, {"data": {"epoch": 0, "batches": 5}, "rng": {}})
    assert url == str(tmp_path / "step_00000005")
    m = store.read_manifest(5)
    assert m["format_version"] == 1 and m["step"] == 5
    assert m["files"] == {"model.safetensors": {k: record[k] for k in
                                                ("size", "xxh3_128", "block_size", "blocks")}}
    assert isinstance(m["committed_at"], float)
    assert m["data"] == {"epoch": 0, "batches": 5}
    assert store.committed_steps() == [5] and store.latest_step() == 5
    assert not list(tmp_path.glob("**/*.tmp"))


def test_meta_may_not_override_the_fields_the_store_owns(tmp_path):
    store = CheckpointStore(str(tmp_path))
    record = store.write_part(1, "model", state(1))
    with pytest.raises(ValueError, match="step"):
        store.commit(1, {"model": record}, {"step": 2})


@pytest.mark.parametrize("damage", ["missing", "wrong size"])
def test_commit_refuses_a_part_that_is_not_there_as_recorded(tmp_path, damage):
    store = CheckpointStore(str(tmp_path))
    record = store.write_part(1, "model", state(1))
    if damage == "missing":
        os.remove(part_path(tmp_path, 1, "model"))
    else:
        record = {**record, "size": record["size"] + 1}
    with pytest.raises(CheckpointError, match="model.safetensors"):
        store.commit(1, {"model": record}, {})
    assert store.committed_steps() == []
    assert not (tmp_path / "step_00000001" / "manifest.json").exists()


def test_rewriting_a_committed_step_withdraws_it_until_recommitted(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 1)
    record = store.write_part(1, "model", {"model.embed.weight": torch.zeros(2)})
    assert store.committed_steps() == []
    store.commit(1, {"model": record}, {})
    assert torch.equal(store.read(1)[1]["model.embed.weight"], torch.zeros(2))


def test_keys_filter_loads_only_selected_tensors_and_skips_files_without_them(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 1)
    flip_byte(part_path(tmp_path, 1, "optim"))  # never read by a model-only restore
    _, tensors = store.read(1, keys=lambda k: k.startswith("model."))
    assert tensors.keys() == {"model.embed.weight"}
    with pytest.raises(CheckpointError, match="optim.safetensors"):
        store.read(1)


def test_read_into_fills_the_callers_tensors_that_fit_and_allocates_the_rest(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 1)
    live = {"model.embed.weight": torch.nn.Parameter(torch.zeros(8, 4)),  # in place
            "optim.embed.weight.exp_avg": torch.zeros(4, 8),  # another shape: not
            "optim.embed.weight.step": torch.tensor(0.0)}  # another dtype: not
    _, tensors = store.read(1, into=live)
    assert_state(tensors, 1)
    assert tensors["model.embed.weight"] is live["model.embed.weight"]
    assert torch.equal(live["model.embed.weight"], state(1)["model.embed.weight"])
    assert not torch.equal(live["optim.embed.weight.exp_avg"], torch.ones(4, 8))
    assert live["optim.embed.weight.step"].item() == 0.0


def test_a_key_not_asked_for_is_never_read_into_its_tensor(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 1)
    live = {"optim.embed.weight.exp_avg": torch.zeros(8, 4)}
    _, tensors = store.read(1, keys=lambda k: k != "optim.embed.weight.exp_avg", into=live)
    assert "optim.embed.weight.exp_avg" not in tensors
    assert torch.equal(live["optim.embed.weight.exp_avg"], torch.zeros(8, 4))


def test_a_corrupt_step_read_in_place_is_overwritten_by_the_good_one_loaded(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 1)
    save(store, 2)
    flip_byte(part_path(tmp_path, 2, "optim"))  # found after the model part was read in place
    live = {k: torch.zeros_like(v) for k, v in state(1).items()}
    with pytest.warns(CheckpointWarning, match="optim.safetensors"):
        manifest, tensors = store.read(into=live)
    assert manifest["step"] == 1
    assert_state(tensors, 1)
    assert all(tensors[k] is live[k] for k in live)


# -- retention -----------------------------------------------------------------------------


def test_keep_last_keeps_the_newest_commits_and_clears_stale_leftovers(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2)
    for step in (1, 2, 3):
        save(store, step)
    store.write_part(4, "model", state(4))  # a write that crashed before its commit
    store.write_part(9, "model", state(9))  # a newer write still in progress
    save(store, 5)
    save(store, 6)
    assert store.committed_steps() == [5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000005", "step_00000006", "step_00000009"]


def test_without_keep_last_nothing_is_deleted(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for step in (1, 2, 3):
        save(store, step)
    assert store.committed_steps() == [1, 2, 3]


# -- damaged checkpoints -------------------------------------------------------------------


def test_flipped_byte_is_skipped_with_a_warning_naming_the_file_and_previous_is_used(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 1)
    save(store, 2)
    bad = part_path(tmp_path, 2, "model")
    flip_byte(bad)
    assert store.latest_step() == 2  # sizes are intact: only hashing can tell
    with pytest.warns(CheckpointWarning, match=bad):
        manifest, tensors = store.load_latest_good()
    assert manifest["step"] == 1
    assert_state(tensors, 1)
    with pytest.warns(CheckpointWarning, match=bad):
        assert store.read()[0]["step"] == 1
    with pytest.raises(CheckpointError, match=f"{bad}: xxh3_128"):
        store.read(2)


def test_a_checkpoint_recorded_with_sha256_blocks_still_verifies(tmp_path):
    """Checkpoints written before XXH3-128 record sha256 digests: whole reads and rows (their
    blocks alone) load, and a flipped byte is still caught."""
    store = CheckpointStore(str(tmp_path), block_size=64)
    record = store.write_part(1, "model", {"model.w": WHOLE.clone()})
    store.commit(1, {"model": record}, {})
    manifest = tmp_path / "step_00000001" / "manifest.json"
    m = json.loads(manifest.read_text())
    path = part_path(tmp_path, 1, "model")
    data = open(path, "rb").read()
    blocks = [hashlib.sha256(data[i:i + 64]).hexdigest() for i in range(0, len(data), 64)]
    m["files"]["model.safetensors"] = {
        "size": len(data), "block_size": 64, "blocks": blocks,
        "sha256": hashlib.sha256(b"".join(bytes.fromhex(b) for b in blocks)).hexdigest()}
    manifest.write_text(json.dumps(m))
    assert torch.equal(store.read(1)[1]["model.w"], WHOLE)
    assert torch.equal(store.read(1, rows={"model.w": (2, 4)})[1]["model.w"], WHOLE[2:4])
    flip_byte(path)
    with pytest.raises(CheckpointError, match=f"{path}: sha256 .* does not match"):
        store.read(1)
    with pytest.raises(CheckpointError, match="block .* does not match the manifest's sha256"):
        store.read(1, rows={"model.w": (WHOLE.shape[0] - 1, WHOLE.shape[0])})


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 10)


@pytest.mark.parametrize("part, damage, read_error", [
    ("optim", _truncate, "truncated"),  # a part cut short
    ("model", os.remove, None),  # a part missing
])
def test_a_damaged_part_is_skipped_with_a_warning_naming_the_file(tmp_path, part, damage,
                                                                  read_error):
    store = CheckpointStore(str(tmp_path))
    save(store, 1)
    save(store, 2)
    bad = part_path(tmp_path, 2, part)
    damage(bad)
    with pytest.warns(CheckpointWarning, match=bad):
        assert store.latest_step() == 1
    with pytest.warns(CheckpointWarning, match=bad):
        assert store.load_latest_good()[0]["step"] == 1
    if read_error:
        with pytest.raises(CheckpointError, match=read_error):
            store.read(2)


def test_a_part_that_shrinks_while_it_is_read_ended_early(tmp_path, monkeypatch):
    """A part cut short after its size was checked (replaced or truncated mid-restore) is one
    error naming the file, whether it is read whole or by rows, not a short tensor."""
    store = CheckpointStore(str(tmp_path), block_size=32)
    store.commit(1, save_sharded(store, 1, [(0, 5), (5, 10)]), {})
    path = part_path(tmp_path, 1, "shard1")
    sizes = {p: os.path.getsize(p) for p in [path, part_path(tmp_path, 1, "shard0")]}
    monkeypatch.setattr(store.fs, "size", lambda p: sizes[p])  # as checked before the cut
    os.truncate(path, sizes[path] - 20)
    with pytest.raises(CheckpointError, match=f"{path}: ended early"):
        store.read(1)
    with pytest.raises(CheckpointError, match=f"{path}: ended early"):
        store.read(1, rows={"model.w": (6, 10)})


def test_step_without_manifest_is_not_a_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 1)
    store.write_part(2, "model", state(2))
    store.write_part(2, "optim", state(2))
    assert store.committed_steps() == [1]
    assert store.latest_step() == 1
    assert store.read()[0]["step"] == 1
    with pytest.raises(CheckpointError, match="never committed"):
        store.read(2)


def test_a_reader_names_the_half_written_steps_it_passes_over(tmp_path):
    """eval and convert (`open_checkpoint`) load the newest committed step and say which
    newer step directories they skipped: a save that failed, was interrupted or is running."""
    save(CheckpointStore(str(tmp_path)), 1)
    CheckpointStore(str(tmp_path)).write_part(2, "model", state(2))
    (tmp_path / "step_00000003").mkdir()
    with pytest.warns(CheckpointWarning) as seen:
        manifest, tensors = open_checkpoint(str(tmp_path))
    assert manifest["step"] == 1
    assert_state(tensors, 1)
    assert [str(w.message) for w in seen] == [
        f"skipping checkpoint step {s}: {tmp_path}/step_0000000{s} has no manifest.json: a save "
        "that failed, was interrupted or is in progress" for s in (3, 2)]


def test_a_failed_write_leaves_no_temporary_file_and_no_empty_directory(tmp_path):
    store = CheckpointStore(str(tmp_path))

    def full(f):
        f.write(b"x" * 1000)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        store._write(f"{tmp_path}/step_00000002/model.safetensors", full)
    assert list(tmp_path.iterdir()) == []


def test_the_sweep_at_start_deletes_debris_and_never_a_committed_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=1)
    save(store, 1)
    store.write_part(2, "model", state(2))  # a save that never committed
    (tmp_path / "step_00000001" / "optim.safetensors.tmp").write_bytes(b"torn")
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / ".relaytrain-probe-0123").write_bytes(b"left by a killed start")
    assert store.sweep() == [f"{tmp_path}/step_00000001/optim.safetensors.tmp",
                             "uncommitted step 2", "uncommitted step 3",
                             f"{tmp_path}/.relaytrain-probe-0123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    assert sorted(os.listdir(tmp_path / "step_00000001")) == [
        "manifest.json", "model.record.json", "model.safetensors", "optim.record.json",
        "optim.safetensors"]
    assert store.verify(1)["step"] == 1 and store.sweep() == []


def test_a_full_disk_releases_only_what_retention_would_delete_once_the_save_commits(tmp_path):
    """keep_last K: a save that meets a full disk may delete all but the newest K - 1
    committed steps (its commit would retire them), never the newest; K = 1 keeps the newest."""
    for keep_last, released in ((3, [1, 2]), (2, [1, 2, 3]), (1, [1, 2, 3])):
        root = tmp_path / str(keep_last)
        store = CheckpointStore(str(root))
        for step in (1, 2, 3, 4):
            save(store, step)
        store.write_part(0, "model", state(0))  # an uncommitted leftover older than the newest
        store.keep_last = keep_last
        assert store.release_for_space() == [0, *released]
        assert store.committed_steps() == [s for s in (1, 2, 3, 4) if s not in released]
    assert CheckpointStore(str(tmp_path / "1")).release_for_space() == []  # keep_last None


@pytest.mark.parametrize("manifest", [
    b'{"format_version": 1, "step": 2, "fil',  # torn write
    b'{"format_version": 2, "step": 2, "files": {}}',  # from the future
    b'{"format_version": 1, "step": 7, "files": {}}',  # belongs to another step
    b'{"format_version": 1, "step": 2, "files": {"../step_00000001/model.safetensors":'
    b' {"size": 1, "sha256": "x"}}}',  # escapes its directory
])
def test_malformed_manifest_is_skipped(tmp_path, manifest):
    store = CheckpointStore(str(tmp_path))
    save(store, 1)
    save(store, 2)
    (tmp_path / "step_00000002" / "manifest.json").write_bytes(manifest)
    with pytest.warns(CheckpointWarning, match="step_00000002/manifest.json"):
        assert store.load_latest_good()[0]["step"] == 1


class _Tripwire:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_nothing_from_storage_is_ever_unpickled(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    save(store, 1)
    sentinel = tmp_path / "unpickled"
    payload = pickle.dumps({"model.embed.weight": _Tripwire(str(sentinel))})
    # a pickle next to a good checkpoint, and a committed step whose only part is a pickle
    (tmp_path / "ckpt" / "step_00000001" / "model.pt").write_bytes(payload)
    step2 = tmp_path / "ckpt" / "step_00000002"
    step2.mkdir()
    (step2 / "model.safetensors").write_bytes(payload)
    (step2 / "manifest.json").write_text(json.dumps({
        "format_version": 1, "step": 2, "files": {"model.safetensors": {
            "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}}}))
    with pytest.warns(CheckpointWarning, match="not a valid safetensors file"):
        manifest, tensors = store.load_latest_good()
    assert manifest["step"] == 1
    assert_state(tensors, 1)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        open_checkpoint(str(step2))
    assert not sentinel.exists()


# -- open_checkpoint -----------------------------------------------------------------------


def test_open_checkpoint_accepts_a_run_dir_a_root_a_step_dir_or_a_manifest(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    store = CheckpointStore(str(root))
    save(store, 1)
    save(store, 2)
    assert open_checkpoint(str(tmp_path / "run"))[0]["step"] == 2
    assert open_checkpoint(str(root) + "/")[0]["step"] == 2
    manifest, tensors = open_checkpoint(str(root / "step_00000001"))
    assert manifest["step"] == 1
    assert_state(tensors, 1)
    assert open_checkpoint(str(root / "step_00000001" / "manifest.json"))[0]["step"] == 1
    _, tensors = open_checkpoint(str(root), keys=lambda k: k.endswith(".step"))
    assert tensors.keys() == {"optim.embed.weight.step"}


def test_open_checkpoint_follows_a_run_dirs_configured_checkpoint_url(tmp_path):
    elsewhere = tmp_path / "bucket" / "ckpts"
    save(CheckpointStore(str(elsewhere)), 4)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"run_dir: {run}\ncheckpoint:\n  url: {elsewhere}\n")
    assert open_checkpoint(str(run))[0]["step"] == 4


def test_open_checkpoint_says_in_one_line_when_nothing_loads(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.write_part(1, "model", state(1))
    targets = {str(tmp_path / "nowhere"): "expected step_NNNNNNNN/manifest.json",
               str(tmp_path): "expected step_NNNNNNNN/manifest.json",
               str(tmp_path / "ckpt" / "step_00000001"): "never committed"}
    for target, message in targets.items():
        with pytest.raises(CheckpointError, match=message) as err:
            open_checkpoint(target)
        assert isinstance(err.value, UserError) and "\n" not in str(err.value)
    save(store, 2)
    flip_byte(part_path(tmp_path / "ckpt", 2, "model"))
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="verifies"):
        open_checkpoint(str(tmp_path / "ckpt"))


# -- object stores -------------------------------------------------------------------------


def test_object_store_path_needs_no_directories_or_renames(monkeypatch):
    def no_rename(*args, **kwargs):
        raise AssertionError("object stores cannot rename atomically")

    for name in ("mv", "rename", "copy", "makedirs", "mkdir"):
        monkeypatch.setattr(MemoryFileSystem, name, no_rename)
    puts = []
    real_pipe = MemoryFileSystem.pipe_file
    monkeypatch.setattr(MemoryFileSystem, "pipe_file",
                        lambda self, path, *a, **k: (puts.append(path),
                                                     real_pipe(self, path, *a, **k))[1])
    url = f"memory://ckpt-{uuid.uuid4().hex}"
    store = CheckpointStore(url, keep_last=1)
    try:
        save(store, 1)
        save(store, 2)
        assert store.committed_steps() == [2]
        # One PUT per part record (each after its part's upload), then the manifest.
        assert [p.rsplit("/", 2)[-2:] for p in puts] == [
            [f"step_0000000{s}", name] for s in (1, 2)
            for name in ("model.record.json", "optim.record.json", "manifest.json")]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            manifest, tensors = open_checkpoint(url)
        assert manifest["step"] == 2
        assert_state(tensors, 2)
    finally:
        fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


# -- shards and ranged reads ---------------------------------------------------------------

WHOLE = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)


def save_sharded(store: CheckpointStore, step: int, cuts: list[tuple[int, int]]) -> dict:
    """WHOLE written as row pieces, one part each (a sharded run's workers), plus an unsharded
    scalar in the first."""
    records = {}
    for i, (a, b) in enumerate(cuts):
        tensors = {"model.w": WHOLE[a:b].clone()}
        if i == 0:
            tensors["optim.w.step"] = torch.tensor(3.0)
        records[f"shard{i}"] = store.write_part(
            step, f"shard{i}", tensors, shards={"model.w": {"shape": [10, 6], "rows": [a, b]}})
    return records


def test_shards_written_apart_read_back_whole_and_their_manifest_records_them(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.commit(1, save_sharded(store, 1, [(0, 4), (4, 8), (8, 10)]), {})
    manifest, tensors = store.read(1)
    assert torch.equal(tensors["model.w"], WHOLE) and tensors["optim.w.step"].item() == 3.0
    assert manifest["files"]["shard1.safetensors"]["shards"] == \
        {"model.w": {"shape": [10, 6], "rows": [4, 8]}}


@pytest.mark.parametrize(("cuts", "why"), [([(0, 4), (8, 10)], r"\(0, 4\), \(8, 10\)"),
                                           ([(0, 6), (4, 10)], r"\(0, 6\), \(4, 10\)"),
                                           ([(0, 4), (4, 8)], "cover rows 0:8 of 10")])
def test_a_commit_whose_shards_do_not_tile_every_tensor_is_refused(tmp_path, cuts, why):
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(CheckpointError, match=f"cannot commit step 1: .*model.w.*{why}"):
        store.commit(1, save_sharded(store, 1, cuts), {})
    assert store.committed_steps() == []


def test_a_shard_must_be_the_rows_it_claims(tmp_path):
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(ValueError, match="not rows 0:5"):
        store.write_part(1, "shard0", {"model.w": WHOLE[:4]},
                         shards={"model.w": {"shape": [10, 6], "rows": [0, 5]}})


@pytest.mark.parametrize("cuts", [[(0, 4), (4, 8), (8, 10)], [(0, 10)]])
def test_rows_are_read_from_only_the_blocks_holding_them(tmp_path, cuts):
    """A block holding none of the rows asked is not read: damage there goes unseen by a
    ranged read and is caught by a whole one; damage in a block read is caught."""
    store = CheckpointStore(str(tmp_path), block_size=32)
    store.commit(1, save_sharded(store, 1, cuts), {})
    _, got = store.read(1, rows={"model.w": (5, 7)})
    assert torch.equal(got["model.w"], WHOLE[5:7]) and got["optim.w.step"].item() == 3.0
    last = part_path(tmp_path, 1, f"shard{len(cuts) - 1}")
    # row 9's last value (the scalar, written after it, ends the file with one part)
    flip_byte(last, offset_from_end=1 + (4 if len(cuts) == 1 else 0))
    assert torch.equal(store.read(1, rows={"model.w": (3, 7)})[1]["model.w"], WHOLE[3:7])
    with pytest.raises(CheckpointError, match=r"block \d+ .* does not match"):
        store.read(1, rows={"model.w": (8, 10)})
    with pytest.raises(CheckpointError, match="corrupt"):
        store.read(1)


def test_rows_are_fetched_as_parallel_ranged_requests_of_whole_blocks(tmp_path, monkeypatch,
                                                                      slow_ranges):
    """Contiguous blocks come in requests of at most `range_size` bytes, RANGES_IN_FLIGHT of
    them at once, each holding whole blocks; the rows are the same."""
    monkeypatch.setattr(streaming, "MIN_RANGE", 64)  # two 32-byte blocks a request
    store = CheckpointStore(str(tmp_path), block_size=32)
    store.commit(1, save_sharded(store, 1, [(0, 10)]), {})
    requests = slow_ranges(store.fs)
    _, got = store.read(1, rows={"model.w": (1, 9)})
    assert torch.equal(got["model.w"], WHOLE[1:9])
    assert len(requests.calls) > streaming.RANGES_IN_FLIGHT
    assert all(start % 32 == 0 and end - start <= 64 for start, end in requests.calls)
    assert requests.most == streaming.RANGES_IN_FLIGHT


def test_pieces_are_never_read_into_the_callers_tensor_of_their_shape(tmp_path):
    """Two pieces of one shape would both land in it: a tensor is read in place only whole."""
    store = CheckpointStore(str(tmp_path))
    store.commit(1, save_sharded(store, 1, [(0, 5), (5, 10)]), {})
    live = {"model.w": torch.zeros(5, 6)}
    _, got = store.read(1, into=live)
    assert torch.equal(got["model.w"], WHOLE) and torch.equal(live["model.w"], torch.zeros(5, 6))


def test_rows_one_piece_holds_all_of_are_read_into_the_callers_tensor(tmp_path):
    """A sharded worker restoring its own rows reads them into its shard; rows that two pieces
    hold are copied into it once both are verified, never read over it."""
    store = CheckpointStore(str(tmp_path), block_size=32)
    store.commit(1, save_sharded(store, 1, [(0, 4), (4, 8), (8, 10)]), {})
    mine = torch.zeros(4, 6)
    _, got = store.read(1, rows={"model.w": (4, 8)}, into={"model.w": mine})
    assert got["model.w"] is mine and torch.equal(mine, WHOLE[4:8])
    straddling = torch.zeros(4, 6)
    _, got = store.read(1, rows={"model.w": (2, 6)}, into={"model.w": straddling})
    assert got["model.w"] is straddling and torch.equal(straddling, WHOLE[2:6])
    piece_shaped = torch.zeros(4, 6)  # no rows asked of model.w: it comes whole, from 3 pieces
    _, got = store.read(1, rows={"model.other": (0, 1)}, into={"model.w": piece_shaped})
    assert torch.equal(got["model.w"], WHOLE) and torch.equal(piece_shaped, torch.zeros(4, 6))
    flip_byte(part_path(tmp_path, 1, "shard1"), offset_from_end=90)  # shard1 ends with rows 4:8
    kept = torch.zeros(4, 6)
    with pytest.raises(CheckpointError, match="shard1.*corrupt"):
        store.read(1, rows={"model.w": (2, 6)}, into={"model.w": kept})
    assert torch.equal(kept, torch.zeros(4, 6))


def test_rows_of_a_checkpoint_hashed_whole_and_an_empty_chunk(tmp_path):
    """A part from before block hashing (one sha256 over the file) is read whole, then cut."""
    store = CheckpointStore(str(tmp_path))
    record = store.write_part(1, "model", {"model.w": WHOLE.clone()})
    store.commit(1, {"model": record}, {})
    manifest = tmp_path / "step_00000001" / "manifest.json"
    m = json.loads(manifest.read_text())
    data = open(part_path(tmp_path, 1, "model"), "rb").read()
    m["files"]["model.safetensors"] = {"size": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()}
    manifest.write_text(json.dumps(m))
    assert torch.equal(store.read(1, rows={"model.w": (2, 9)})[1]["model.w"], WHOLE[2:9])
    empty = store.read(1, rows={"model.w": (10, 10)})[1]["model.w"]
    assert empty.shape == (0, 6) and empty.dtype == torch.float32
