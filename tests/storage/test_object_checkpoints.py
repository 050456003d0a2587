"""Checkpoints on s3:// and gs://, each test against its own freshly started local server."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qsl, urlsplit

import pytest
import torch
import xxhash

import relaytrain.checkpoint.streaming as streaming
from relaytrain.checkpoint.store import CheckpointStore, CheckpointWarning, open_checkpoint
from relaytrain.checkpoint.streaming import block_root
from relaytrain.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)

BLOCK = 5 << 20  # the smallest S3 multipart piece; a larger part is uploaded in pieces


def small_blocks(server) -> dict:
    """Options that make a part over 5 MiB a multipart (S3) or resumable (GCS) upload."""
    return {"default_block_size": BLOCK} if server.scheme == "s3" else {"block_size": BLOCK}


def training_state(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"model.embed.weight": torch.randn(3072, 1024, generator=g),  # 12 MiB
                  "model.norm.weight": torch.randn(1024, generator=g).bfloat16()},
        "optim": {"optim.embed.weight.exp_avg": torch.randn(64, 8, generator=g),
                  "optim.embed.weight.step": torch.tensor(7, dtype=torch.int64)},
    }


def save(store: CheckpointStore, step: int, state: dict) -> None:
    parts = {p: store.write_part(step, p, t) for p, t in state.items()}
    store.commit(step, parts, {"data": {"batch": step}})


def assert_same(tensors: dict[str, torch.Tensor], state: dict) -> None:
    expected = {k: t for part in state.values() for k, t in part.items()}
    assert tensors.keys() == expected.keys()
    for k, t in expected.items():
        assert tensors[k].dtype == t.dtype and torch.equal(tensors[k], t), k


def test_checkpoint_round_trip_with_concurrent_multipart_parts(object_server,
                                                               monkeypatch) -> None:
    monkeypatch.setattr(streaming, "MIN_UPLOAD", 0)  # the options' 5 MiB pieces
    url = object_server.url("run/checkpoints")
    store = CheckpointStore(url, storage_options=small_blocks(object_server))
    state = training_state(0)
    with ThreadPoolExecutor(2) as pool:  # ranks write their parts at the same time
        futures = {p: pool.submit(store.write_part, 7, p, t) for p, t in state.items()}
        parts = {p: f.result() for p, f in futures.items()}
    assert parts["model"]["size"] > 2 * BLOCK
    store.commit(7, parts, {"data": {"batch": 7}})

    manifest = store.read_manifest(7)
    for name, info in manifest["files"].items():  # the stored bytes are what the manifest says
        data = store.fs.cat_file(f"{store.root}/step_00000007/{name}")
        size = info["block_size"]
        blocks = [xxhash.xxh3_128(data[i:i + size]).hexdigest()
                  for i in range(0, len(data), size)]
        assert (len(data), blocks, block_root(blocks, "xxh3_128")) == \
            (info["size"], info["blocks"], info["xxh3_128"])
    manifest, tensors = open_checkpoint(url)  # a fresh reader, configured by the environment
    assert manifest["step"] == 7 and manifest["data"] == {"batch": 7}
    assert_same(tensors, state)


def test_a_part_goes_up_in_pieces_of_the_upload_size(object_server, http_requests,
                                                     monkeypatch) -> None:
    """An upload goes in pieces (S3 multipart, GCS resumable) of at least MIN_UPLOAD bytes: with
    a client block smaller than a write (gcsfs: 5 MiB), each 16 MiB write would be a request
    of its own. A 40 MiB part is one piece, not three or more."""
    store = CheckpointStore(object_server.url("ckpt"),
                            storage_options=small_blocks(object_server))

    def pieces_to_write(least: int) -> int:
        monkeypatch.setattr(streaming, "MIN_UPLOAD", least)
        http_requests.clear()
        store.write_part(1, "model", {"w": torch.randn(10 << 20)})
        return sum(bool(re.search(r"[?&](partNumber|upload_id)=", url))
                   for _, url in http_requests)

    assert pieces_to_write(64 << 20) <= 1  # S3: one PUT; GCS: one piece of a resumable upload
    assert pieces_to_write(0) >= 3


def test_manifest_is_written_only_when_every_part_is_complete(object_server) -> None:
    store = CheckpointStore(object_server.url("ckpt"))
    model = store.write_part(3, "model", training_state(1)["model"])
    missing = {"file": "optim.safetensors", "size": 100, "sha256": "0" * 64}
    with pytest.raises(CheckpointError, match="part 'optim' .* is missing"):
        store.commit(3, {"model": model, "optim": missing}, {})
    with pytest.raises(CheckpointError, match=f"expected {model['size'] + 1} bytes"):
        store.commit(3, {"model": {**model, "size": model["size"] + 1}}, {})
    assert not store.fs.exists(f"{store.root}/step_00000003/manifest.json")
    assert store.latest_step() is None and store.committed_steps() == []


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(object_server) -> None:
    store = CheckpointStore(object_server.url("ckpt"))
    save(store, 1, training_state(1))
    save(store, 2, training_state(2))
    path = f"{store.root}/step_00000002/optim.safetensors"
    data = bytearray(store.fs.cat_file(path))
    data[-1] ^= 0xFF  # same size, one flipped byte: only the digest can tell
    store.fs.pipe_file(path, bytes(data))
    with pytest.warns(CheckpointWarning, match="step 2: .*optim.safetensors: xxh3_128"):
        manifest, tensors = store.load_latest_good()
    assert manifest["step"] == 1
    assert_same(tensors, training_state(1))


def _root_listings(requests: list[tuple[str, str]], store: CheckpointStore) -> list[dict]:
    """Query parameters of the requests that list objects under the checkpoint root itself
    (S3 ListObjectsV2, or GCS objects.list, with the root as prefix)."""
    root = store.root.split("/", 1)[1] + "/"  # the root's key prefix within the bucket
    found = []
    for method, url in requests:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        listing = "list-type" in query or parts.path.endswith("/o")
        if method == "GET" and listing and query.get("prefix") == root:
            found.append(query)
    return found


def test_newest_checkpoint_is_found_with_one_root_listing(object_server, http_requests) -> None:
    """The root is listed once, delimited: one entry per checkpoint (a page holds 1000), not one
    per object, then only the newest candidates are looked at."""
    store = CheckpointStore(object_server.url("ckpt"))
    objects = {}
    for step in range(1, 200):  # 199 committed checkpoints (sizes match their manifests)
        d = f"{store.root}/step_{step:08d}"
        objects[f"{d}/model.safetensors"] = b"x"
        objects[f"{d}/manifest.json"] = json.dumps({
            "format_version": 1, "step": step,
            "files": {"model.safetensors": {"size": 1, "sha256": "0" * 64}}}).encode()
    store.fs.pipe(objects)
    save(store, 200, training_state(200))
    store.write_part(201, "model", training_state(201)["model"])  # a save still in progress

    http_requests.clear()
    assert store.latest_step() == 200
    (listing,) = _root_listings(http_requests, store)
    assert listing["delimiter"] == "/"
    assert len(http_requests) <= 4, http_requests  # + the two candidates' listings, 1 manifest

    http_requests.clear()
    manifest, tensors = store.load_latest_good()
    assert manifest["step"] == 200 and len(_root_listings(http_requests, store)) == 1
    assert_same(tensors, training_state(200))


def test_a_failed_upload_completes_no_object(object_server, monkeypatch) -> None:
    """An upload in pieces that fails midway is discarded (S3 multipart aborted, GCS resumable
    upload cancelled), never completed with the pieces already sent."""
    monkeypatch.setattr(streaming, "MIN_UPLOAD", 0)  # the options' 5 MiB pieces
    store = CheckpointStore(object_server.url("run/checkpoints"),
                            storage_options=small_blocks(object_server))
    path = f"{store.root}/step_00000002/stage0.safetensors"

    def fails_midway(f) -> None:
        f.write(b"x" * (3 * BLOCK))  # pieces gone up already
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        store._write(path, fails_midway)
    store.fs.invalidate_cache()
    assert not store.fs.exists(path) and store.sweep() == []


def uploads(store: CheckpointStore) -> list[str]:
    """The keys of the S3 multipart uploads in the store's bucket never completed or aborted."""
    bucket = store.root.split("/")[0]
    return [u["Key"] for u in store.fs.call_s3("list_multipart_uploads",
                                               Bucket=bucket).get("Uploads", [])]


def test_a_failed_upload_is_aborted_and_the_sweep_aborts_the_orphans(s3_server,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr(streaming, "MIN_UPLOAD", 0)  # the options' 5 MiB pieces
    store = CheckpointStore(s3_server.url("run/checkpoints"),
                            storage_options=small_blocks(s3_server))
    path = f"{store.root}/step_00000002/stage0.safetensors"

    def fails_midway(f) -> None:
        f.write(b"x" * (3 * BLOCK))  # two pieces gone up already
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        store._write(path, fails_midway)
    assert uploads(store) == [] and not store.fs.exists(path)  # aborted, nothing completed
    bucket, _, key = path.partition("/")
    store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)  # a killed writer's
    assert uploads(store) == [key]
    assert store.sweep() == [f"upload of s3://{path}"] and uploads(store) == []


@pytest.mark.timeout(120)
def test_a_bucket_that_refuses_writes_is_one_line_exit_2_before_step_1(
        s3_server, tmp_path, corpus_data, capsys, monkeypatch) -> None:
    """A bucket that does not exist, and a server that refuses the credentials (moto with
    authentication enforced: the keys are unknown to it), stop the run before step 1."""
    from relaytrain.cli import main
    from tests.storage.servers import S3Server

    def train(url: str) -> str:
        run = tmp_path / "run"
        assert main(["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={corpus_data}",
                     "log.progress=false", f"checkpoint.url={url}"]) == 2
        assert not run.exists()
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(
            f"relaytrain: error: config key 'checkpoint.url': {url} is not writable ("), err
        return err

    assert "(FileNotFoundError: " in train("s3://no-such-bucket/run/checkpoints")

    class Locked(S3Server):
        def _process_env(self) -> dict[str, str]:  # authentication after the bucket exists
            return {**super()._process_env(), "INITIAL_NO_AUTH_ACTION_COUNT": "1"}

    with Locked() as locked:
        for name, value in locked.env.items():
            monkeypatch.setenv(name, value)
        assert "(PermissionError: The AWS Access Key Id you provided does not exist" in \
            train(locked.url("run/checkpoints"))


@pytest.mark.timeout(120)
def test_a_run_on_an_object_store_proves_it_writable_and_leaves_no_probe(
        object_server, tmp_path, corpus_data, capsys) -> None:
    from relaytrain.cli import main

    url = object_server.url("run/checkpoints")
    assert main(["train", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                 f"data.path={corpus_data}", "log.progress=false", "train.max_steps=2",
                 "eval.every=0", f"checkpoint.url={url}"]) == 0
    assert f"checkpoints: {url} (step 2)" in capsys.readouterr().out
    store = CheckpointStore(url)
    assert store.committed_steps() == [2]
    assert [p for p in store.fs.find(store.root) if ".relaytrain-probe-" in p] == []
