"""HF interop: one name mapping, config translation, and an exact conversion round trip."""

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from relaytrain.checkpoint.store import CheckpointStore, open_checkpoint
from relaytrain.cli import main
from relaytrain.errors import CheckpointError
from relaytrain.model.config import PRESETS
from relaytrain.model.hf import (
    from_hf_config,
    hf_to_ours_name,
    ours_to_hf_name,
    to_hf_config,
)
from relaytrain.model.olmo3 import Olmo3

torch.set_num_threads(1)
YARN = {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}
CFG = dataclasses.replace(PRESETS["tiny"].with_vocab(500), n_kv_heads=2, rope_scaling=YARN)


def test_names_map_onto_the_real_hf_model_one_to_one():
    hf_names = {n for n, _ in transformers.Olmo3ForCausalLM(to_hf_config(CFG)).named_parameters()}
    ours = [n for n, _ in Olmo3(CFG).named_parameters()]
    assert {ours_to_hf_name(n) for n in ours} == hf_names
    assert all(hf_to_ours_name(ours_to_hf_name(n)) == n for n in ours)
    assert ours_to_hf_name("layers.0.attn_norm.weight") == \
        "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(ValueError):
        hf_to_ours_name("model.layers.0.input_layernorm.weight")


@pytest.mark.parametrize("cfg", [CFG, PRESETS["olmo3-7b"], PRESETS["olmo3-32b"]])
def test_config_round_trips_through_hf(cfg):
    hf = to_hf_config(cfg)
    assert hf.vocab_size == cfg.tokenizer_vocab and hf.head_dim == cfg.head_dim
    assert from_hf_config(hf.to_dict()) == cfg


def test_legacy_rope_scaling_is_read_as_hf_reads_it():
    """Pre-5.0 config.json files (the published Olmo 3 ones) keep rope_theta + rope_scaling at
    the top level; HF applies the scaling to full-attention layers only, and so do we."""
    legacy = {
        "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "vocab_size": 100278,
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6, "rope_theta": 500000, "sliding_window": 4096,
        "eos_token_id": 100257, "pad_token_id": 100277, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 8192,
                         "attention_factor": 1.2079441541679836},
    }
    cfg = from_hf_config(legacy)
    assert dataclasses.replace(cfg, max_seq_len=8192, rope_scaling=None, layer_types=()) == \
        dataclasses.replace(PRESETS["olmo3-7b"], layer_types=())
    assert cfg.layer_types == PRESETS["olmo3-7b"].layer_types
    assert to_hf_config(cfg).rope_parameters == \
        transformers.Olmo3Config(**legacy).rope_parameters


def test_non_olmo3_configs_are_rejected():
    with pytest.raises(CheckpointError, match="olmo3"):
        from_hf_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


# --- relaytrain convert -----------------------------------------------------------------------

@pytest.fixture
def hf_dir(tmp_path):
    torch.manual_seed(0)
    model = transformers.Olmo3ForCausalLM(to_hf_config(CFG)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_hf_to_relay_to_hf_is_bit_identical(hf_dir, tmp_path, capsys):
    relay, back = tmp_path / "relay", tmp_path / "back"
    assert main(["convert", "hf-to-relay", str(hf_dir), str(relay)]) == 0
    manifest, tensors = open_checkpoint(str(relay))
    assert manifest["step"] == 0 and manifest["source"] == "hf"
    assert manifest["model"] == CFG.to_dict()
    embed = tensors["model.embed.weight"]
    assert embed.shape == (512, CFG.d_model) and embed.dtype == torch.bfloat16
    assert not embed[500:].any()  # padded rows are zeros

    assert main(["convert", "relay-to-hf", str(relay), str(back)]) == 0
    src, out = load_file(hf_dir / "model.safetensors"), load_file(back / "model.safetensors")
    assert src.keys() == out.keys()
    for name in src:
        assert src[name].dtype == out[name].dtype and torch.equal(src[name], out[name]), name
    cfg_src, cfg_out = (json.loads((d / "config.json").read_text()) for d in (hf_dir, back))
    assert cfg_out == cfg_src and from_hf_config(cfg_out) == CFG
    assert "converted relay-to-hf" in capsys.readouterr().out


def test_a_checkpoint_written_shard_by_shard_converts_to_the_same_hf_weights(hf_dir, tmp_path):
    """A sharded run's checkpoint (each tensor's rows in 3 parts, as 3 shards write them) is
    read whole by `convert relay-to-hf`."""
    relay, sharded, back = tmp_path / "relay", tmp_path / "sharded", tmp_path / "back"
    assert main(["convert", "hf-to-relay", str(hf_dir), str(relay)]) == 0
    manifest, tensors = open_checkpoint(str(relay))
    store = CheckpointStore(str(sharded))
    parts = {}
    for k in range(3):
        mine, where = {}, {}
        for key, t in tensors.items():
            rows = t.shape[0]
            a, b = min(k * -(-rows // 3), rows), min((k + 1) * -(-rows // 3), rows)
            mine[key] = t[a:b].clone()
            where[key] = {"shape": list(t.shape), "rows": [a, b]}
        parts[f"stage0-shard{k}"] = store.write_part(0, f"stage0-shard{k}", mine, where)
    meta = {k: v for k, v in manifest.items()
            if k not in ("format_version", "step", "files", "committed_at")}
    store.commit(0, parts, meta)
    assert len(store.read_manifest(0)["files"]) == 3
    assert main(["convert", "relay-to-hf", str(sharded), str(back)]) == 0
    src, out = load_file(hf_dir / "model.safetensors"), load_file(back / "model.safetensors")
    assert src.keys() == out.keys()
    assert all(torch.equal(src[name], out[name]) for name in src)


def break_config(d):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama",
                                               "architectures": ["LlamaForCausalLM"]}))


def drop_tensor(d):
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "config.json").unlink(), "config.json"),
    (break_config, "olmo3"),
    (drop_tensor, "layers.1.mlp.up_proj.weight"),
    (lambda d: (d / "model.safetensors").unlink(), "safetensors"),
])
def test_bad_hf_input_is_one_line_exit_2_and_writes_nothing(hf_dir, tmp_path, capsys, damage,
                                                            message):
    damage(hf_dir)
    assert main(["convert", "hf-to-relay", str(hf_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_missing_source_and_occupied_destination_are_refused(hf_dir, tmp_path, capsys):
    assert main(["convert", "relay-to-hf", str(tmp_path / "nope"), str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert main(["convert", "hf-to-relay", str(hf_dir), str(taken)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
