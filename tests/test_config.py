"""The run configuration: YAML plus key=value overrides, one clear line for every mistake."""

import pickle
import re
from pathlib import Path

import pytest

from relaytrain.config import check_resume_compatible, config_from_dict, flatten, load_config
from relaytrain.errors import ConfigError
from relaytrain.model.config import PRESETS


def test_defaults_and_overrides_are_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run_dir: r\ntrain:\n  max_steps: 5\noptim:\n  lr: 0.01\n")
    cfg = load_config(path, ["train.global_batch=16", "optim.betas=[0.8, 0.9]",
                             "model.n_layers=3", "determinism=exact"])
    assert cfg.train.max_steps == 5 and cfg.train.global_batch == 16
    assert cfg.optim.lr == 0.01 and cfg.optim.betas == (0.8, 0.9)
    assert cfg.model_config().n_layers == 3
    assert cfg.determinism == "exact"


def test_round_trip_through_dict():
    cfg = load_config(None, ["run_dir=x", "model.preset=small", "parallel.dp=2",
                             "runtime.engine=ray"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_round_trip_through_pickle():
    """The config crosses to every worker as the RunConfig it is (Ray pickles it)."""
    cfg = load_config(None, ["run_dir=x", "model.preset=small", "parallel.dp=2",
                             "runtime.engine=ray", "optim.betas=[0.8, 0.9]",
                             "determinism=exact"])
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and type(back) is type(cfg)
    assert back.optim.betas == (0.8, 0.9) and back.model_config() == cfg.model_config()


@pytest.mark.parametrize("override, needle", [
    ("train.max_stepz=3", "unknown config key 'train.max_stepz'"),
    ("bogus=1", "unknown config key 'bogus'"),
    ("train.max_steps=abc", "config key 'train.max_steps': got 'abc', expected int"),
    ("train.max_steps=true", "config key 'train.max_steps'"),
    ("determinism=maybe", "expected 'exact' | 'fast'"),
    ("model.preset=huge", "config key 'model.preset': got 'huge'"),
    ("train.global_batch=7", "expected a multiple of train.micro_batch=2"),
    ("parallel.dp=2", "need runtime.engine=ray"),
    ("model.n_kv_heads=3", "must divide model.n_heads"),
    ("model.widthh=3", "unknown config key 'model.widthh'"),
    ("model.n_layers=abc", "config key 'model.n_layers': got 'abc', expected int"),
    ("noequals", "not of the form key=value"),
    ("faults.raise_when=[3]", "unknown config key 'faults.raise_when'; accepted keys here: "),
    ("faults.raise_at=[0]", "config key 'faults.raise_at': got [0], expected optimizer steps"),
    ("faults.raise_at=[3]", "'faults.raise_at' needs runtime.engine=ray"),
    ("faults.raise_rank=1", "expected null (a random rank) or 0 .. 0"),
    ("faults.storage_outage_seconds=-2", "'faults.storage_outage_seconds': got -2.0, expected > 0"),
    ("optim.skip_window=5", "config key 'optim.skip_window': got 5, expected >= 6"),
    ("optim.skip_sigma=0", "config key 'optim.skip_sigma': got 0.0, expected > 0"),
    ("optim.schedule=step", "'optim.schedule': got 'step', expected 'cosine' | 'linear'"),
    ("optim.t_max=0", "config key 'optim.t_max': got 0, expected >= 1 (or null: train.max_steps)"),
    ("checkpoint.preempt_grace=0", "'checkpoint.preempt_grace': got 0.0, expected seconds > 0"),
    ("runtime.collective_timeout=0", "'runtime.collective_timeout': got 0.0, expected seconds > 0"),
    ("elastic.replace_timeout=-5", "'elastic.replace_timeout': got -5.0, expected seconds >= 0"),
])
def test_bad_values_name_the_key_and_what_is_accepted(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["run_dir=x", override])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_an_architecture_override_takes_its_fields_type():
    """YAML reads a command line's 1e-06 (no dot) as a string: the model's field says float."""
    cfg = load_config(None, ["run_dir=x", "model.rms_eps=1e-06", "model.n_layers=2"])
    assert cfg.model_config().rms_eps == 1e-6 and isinstance(cfg.model_config().rms_eps, float)


def test_dp_must_split_micro_batches_evenly():
    with pytest.raises(ConfigError, match="must split evenly over the dp x fsdp"):
        load_config(None, ["runtime.engine=ray", "parallel.dp=3", "train.global_batch=8",
                           "train.micro_batch=2"])


def test_exact_mode_refuses_a_sharding_whose_chunks_are_not_whole_vectors():
    """The tiny model's 64-value norm weights in 3 chunks of 22 (parallel/shards.py)."""
    with pytest.raises(ConfigError, match=r"'parallel.fsdp': got 3 with determinism=exact, .*"
                       r"chunks of 22 values.*expected one of \[1, 2, 4\]"):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.fsdp=3",
                                          "determinism=exact", "train.global_batch=6"])
    load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.fsdp=3",
                                      "train.global_batch=6"])  # fast mode: uneven is fine


def test_exact_mode_refuses_sharding_over_cp_ranks_whose_chunks_are_not_whole_vectors():
    """parallel.shard_over_cp at fsdp 1 x cp 3: the same 3 chunks of 22, the key named."""
    over = ["runtime.engine=ray", "parallel.cp=3", "data.seq_len=30", "parallel.shard_over_cp=true"]
    with pytest.raises(ConfigError, match=r"'parallel.shard_over_cp': got true with "
                       r"determinism=exact, .*chunks of 22 values.*expected false"):
        load_config("configs/tiny.yaml", [*over, "determinism=exact"])
    load_config("configs/tiny.yaml", over)  # fast mode: uneven is fine


def test_exact_sharding_on_a_torch_without_custom_reduce_scatter_is_refused(monkeypatch):
    """torch 2.8's FSDP2 has no custom reduce-scatter for exact mode's integers."""
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    with pytest.raises(ConfigError, match=r"determinism=exact, which needs torch >= 2.9 .*"
                                          r"use determinism=fast or fsdp 1"):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.fsdp=2",
                                          "determinism=exact"])
    load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.fsdp=2"])


def test_exact_mode_refuses_bf16_gathers_in_one_line():
    """Exact mode's bits are the unsharded run's, from fp32 weights (parallel/fsdp.py)."""
    with pytest.raises(ConfigError, match=r"^config key 'parallel.fsdp_param_dtype': got "
                                          r"'bf16' with determinism=exact.*expected auto or "
                                          r"fp32 \(or determinism=fast\)$"):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.fsdp=2",
                                          "determinism=exact", "parallel.fsdp_param_dtype=bf16"])
    with pytest.raises(ConfigError, match="'parallel.fsdp_param_dtype': got 'fp16', expected "
                                          "'auto' | 'bf16' | 'fp32'"):
        load_config("configs/tiny.yaml", ["parallel.fsdp_param_dtype=fp16"])
    for dtype in ("auto", "fp32"):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.fsdp=2",
                                          "determinism=exact",
                                          f"parallel.fsdp_param_dtype={dtype}"])
    cfg = load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.fsdp=2",
                                            "parallel.fsdp_param_dtype=bf16"])
    assert cfg.parallel.fsdp_param_dtype == "bf16"
    assert load_config("configs/tiny.yaml").parallel.fsdp_param_dtype == "auto"


@pytest.mark.parametrize("schedule", ["pipedream", "paci"])
def test_sharded_pipeline_stages_run_the_flush_schedules_only(schedule):
    with pytest.raises(ConfigError, match=f"'parallel.fsdp': got 2 with parallel.pp=2 and the "
                                          f"asynchronous schedule '{schedule}'; sharded stages "
                                          "run the flush schedules \\(gpipe, 1f1b, zb-h1, "
                                          "interleaved-1f1b\\)"):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.fsdp=2",
                                          "parallel.pp=2", f"parallel.schedule={schedule}"])
    for flush in ("gpipe", "1f1b", "zb-h1"):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.fsdp=2",
                                          "parallel.pp=2", f"parallel.schedule={flush}"])


@pytest.mark.parametrize("schedule", ["pipedream", "paci"])
def test_context_parallel_pipelines_run_the_flush_schedules_only(schedule):
    """Each stage's DP rank is cp workers (world = dp x fsdp x cp x pp) under the flush
    schedules; an asynchronous one runs its stages' micro-batches out of step: refused."""
    with pytest.raises(ConfigError, match=f"'parallel.cp': got 2 with parallel.pp=2 and the "
                                          f"asynchronous schedule '{schedule}'"):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.cp=2",
                                          "parallel.pp=2", f"parallel.schedule={schedule}"])
    for flush, shards in [("gpipe", "parallel.fsdp=2"), ("1f1b", "parallel.fsdp=2"),
                          ("zb-h1", "parallel.dp=2"), ("interleaved-1f1b", "parallel.dp=2")]:
        cfg = load_config("configs/tiny.yaml", [
            "runtime.engine=ray", "parallel.cp=2", "parallel.pp=2", shards, "model.n_layers=4",
            f"parallel.schedule={flush}"])
        assert cfg.world_size == 8


@pytest.mark.parametrize(("key", "others"), [
    ("predict", ["parallel.schedule=pipedream"]),
    ("predict", ["parallel.schedule=paci", "parallel.paci.mode=mem"]),
    ("predict", ["parallel.schedule=paci", "parallel.paci.flush=true"]),
    ("split", ["parallel.schedule=1f1b"]),
    ("split", ["parallel.schedule=paci", "parallel.paci.mode=mem"])])
def test_paci_split_and_prediction_are_refused_where_they_would_do_nothing(key, others):
    with pytest.raises(ConfigError, match=f"^config key 'parallel.paci.{key}': got true with "
                                          "schedule .*; it takes schedule 'paci'"):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.pp=2", *others,
                                          f"parallel.paci.{key}=true"])
    load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.pp=2",
                                      "parallel.schedule=paci", f"parallel.paci.{key}=true"])


@pytest.mark.parametrize("other", ["model.checkpointing=full", "model.compile=blocks"])
def test_prediction_is_refused_where_a_block_would_not_form_it(other):
    with pytest.raises(ConfigError, match="^config key 'parallel.paci.predict': got true with "
                                          "model.checkpointing=.*; it takes checkpointing none"):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.pp=2",
                                          "parallel.schedule=paci", "parallel.paci.predict=true",
                                          other])


@pytest.mark.parametrize("schedule", [
    ["parallel.schedule=pipedream"], ["parallel.schedule=paci"],
    ["parallel.schedule=paci", "parallel.paci.flush=true", "parallel.paci.a=3"]])
def test_skipping_spikes_is_refused_on_a_pipeline_whose_stages_update_apart(schedule):
    """tiny.yaml: 4 micro-batches per global batch, so paci with flush and a=3 updates twice
    in a batch."""
    with pytest.raises(ConfigError, match=r"^config key 'optim.skip_spikes': got true with "
                                          r"parallel.pp=2 and schedule '(pipedream|paci)' .* "
                                          r"expected a flush schedule \(gpipe, 1f1b, zb-h1, "
                                          r"interleaved-1f1b, or "
                                          r"paci "
                                          r"with parallel.paci.flush=true and parallel.paci.a "
                                          r">= the micro-batches per DP rank\)"):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.pp=2", *schedule,
                                          "optim.skip_spikes=true"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.virtual_stages=2"], "'parallel.virtual_stages': got 2 with "
     "parallel.schedule=1f1b and parallel.pp=2; expected 1, or parallel.schedule="
     "interleaved-1f1b with parallel.pp >= 2"),
    (["parallel.virtual_stages=0"], "'parallel.virtual_stages': got 0, expected >= 1"),
    (["parallel.schedule=interleaved-1f1b", "parallel.pp=3", "model.n_layers=6"],
     "got interleaved-1f1b with 4 micro-batches per data-parallel rank, expected a multiple of "
     "parallel.pp=3"),
    (["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "model.n_layers=3"],
     "parallel.pp x virtual_stages = 4 virtual stages need as many layers"),
    (["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "model.n_layers=4",
      "parallel.stage_layers=[2,2]"], "'parallel.stage_layers': set with interleaved-1f1b")])
def test_virtual_stages_are_interleaved_1f1bs_on_a_model_deep_enough(overrides, message):
    base = ["runtime.engine=ray", "parallel.pp=2"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny.yaml", [*base, *overrides])
    cfg = load_config("configs/tiny.yaml", [*base, "parallel.schedule=interleaved-1f1b",
                                            "parallel.virtual_stages=2", "model.n_layers=4"])
    assert cfg.parallel.virtual_stages == 2
    load_config("configs/tiny.yaml", [*base, "parallel.schedule=interleaved-1f1b",  # sharded
                                      "parallel.virtual_stages=2", "model.n_layers=4",
                                      "parallel.fsdp=2"])
    assert load_config("configs/tiny.yaml").parallel.virtual_stages == 1


def test_skipping_spikes_takes_the_flush_schedules_and_defaults_to_olmo_cores_rule():
    for schedule in (["parallel.schedule=gpipe"], ["parallel.schedule=1f1b"],
                     ["parallel.schedule=zb-h1"],
                     ["parallel.schedule=paci", "parallel.paci.flush=true", "parallel.paci.a=4"]):
        load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.pp=2", *schedule,
                                          "optim.skip_spikes=true"])
    o = load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.pp=2"]).optim
    assert (o.skip_spikes, o.skip_window, o.skip_sigma) == (False, 128, 6.0)  # SkipStepAdamW's
    load_config("configs/tiny.yaml", ["runtime.engine=ray", "parallel.dp=2",
                                      "optim.skip_spikes=true"])


def test_a_storage_outage_on_an_object_store_is_refused_in_one_line(tmp_path, capsys):
    from relaytrain.cli import main

    assert main(["train", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}",
                 "checkpoint.url=s3://user:secret@bucket/ckpt",
                 "faults.storage_outage_at=[2]"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "'faults.storage_outage_at' works on a local checkpoint root" in line
    assert "s3://***@bucket/ckpt" in line and "secret" not in line
    assert not (tmp_path / "run").exists()


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_presets_have_the_published_olmo3_7b_dimensions():
    m = PRESETS["olmo3-7b"]
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.mlp_hidden) == \
        (32, 4096, 32, 32, 128, 11008)
    assert (m.vocab_size, m.tokenizer_vocab, m.rms_eps, m.rope_theta) == \
        (100352, 100278, 1e-6, 500000.0)
    assert (m.max_seq_len, m.sliding_window) == (8192, 4096)
    assert m.layer_types.count("full_attention") == 8 and m.layer_types[-1] == "full_attention"
    assert all(t == "sliding_attention" for i, t in enumerate(m.layer_types) if (i + 1) % 4)


def test_shipped_configs_load():
    paths = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert {"tiny.yaml", "demo.yaml", "olmo3-7b.yaml"} <= {p.name for p in paths}
    for path in paths:
        load_config(path, ["run_dir=x"])


def test_execution_keys_default_to_auto_and_reject_what_cannot_run():
    cfg = load_config(None, ["model.checkpointing=full", "model.compile=none"])
    assert (cfg.model.attention, cfg.model.checkpointing, cfg.model.compile) == \
        ("auto", "full", "none")
    with pytest.raises(ConfigError, match="'model.checkpointing': got 'some', expected 'none'"):
        load_config(None, ["model.checkpointing=some"])
    with pytest.raises(ConfigError, match="'model.compile'"):
        load_config(None, ["model.compile=true"])  # YAML's booleans are not the choices
    with pytest.raises(ConfigError, match="FlexAttention has no CPU backward"):
        load_config(None, ["model.attention=flex", "train.device=cpu"])
    assert load_config(None, ["model.attention=flex", "train.device=cuda"]).model.attention \
        == "flex"
    assert load_config(None, []).model.kernels == "auto"
    for key, cpu_only in (("matmul", "onednn"), ("kernels", "fused")):
        with pytest.raises(ConfigError, match=f"'model.{key}': got '{cpu_only}' with "
                                              "train.device=cuda"):
            load_config(None, [f"model.{key}={cpu_only}", "train.device=cuda"])
    with pytest.raises(ConfigError, match="'model.kernels': got 'triton', expected 'auto'"):
        load_config(None, ["model.kernels=triton"])


def test_a_runs_checkpoints_go_to_checkpoint_url_else_run_dir_checkpoints():
    assert load_config(None, ["run_dir=runs/a"]).checkpoint_url == "runs/a/checkpoints"
    assert load_config(None, ["run_dir=runs/a", "checkpoint.url=s3://b/ck"]).checkpoint_url \
        == "s3://b/ck"


def test_flatten_gives_dotted_keys_with_model_overrides_as_one_value():
    tree = {"train": {"max_steps": 5}, "eval": {},
            "model": {"preset": "tiny", "overrides": {"n_layers": 3}}}
    assert flatten(tree) == {"train.max_steps": 5, "model.preset": "tiny",
                             "model.overrides": {"n_layers": 3}}
    assert flatten(load_config(None, ["run_dir=x"]).to_dict())["parallel.paci.a"] == 1


def test_a_pipeline_layout_must_fit_the_model():
    with pytest.raises(ConfigError, match=r"'parallel.pp': got 4, expected 1 .. model n_layers=3"):
        load_config(None, ["model.n_layers=3", "parallel.pp=4", "runtime.engine=ray"])
    with pytest.raises(ConfigError, match=r"'parallel.stage_layers': got \[1, 1\], expected 2 "
                                          "positive counts summing to n_layers=3"):
        load_config(None, ["model.n_layers=3", "parallel.pp=2", "parallel.stage_layers=[1,1]",
                           "runtime.engine=ray"])


def saved_config(*overrides: str) -> dict:
    return load_config(None, ["run_dir=x", *overrides]).to_dict()


def test_execution_keys_may_change_on_resume():
    saved = saved_config("model.matmul=aten", "model.checkpointing=full", "model.kernels=fused")
    check_resume_compatible(saved, load_config(None, ["run_dir=x", "model.matmul=onednn",
                                                      "model.kernels=torch"]))


def test_a_checkpoint_from_before_model_matmul_existed_resumes():
    saved = saved_config()
    del saved["model"]["matmul"]
    check_resume_compatible(saved, load_config(None, ["run_dir=x"]))


def test_a_checkpoint_from_before_the_schedule_keys_resumes_as_the_cosine():
    saved = saved_config()
    del saved["optim"]["schedule"], saved["optim"]["t_max"]
    check_resume_compatible(saved, load_config(None, ["run_dir=x"]))
    with pytest.raises(ConfigError, match=r"'optim.schedule': .* trained with 'cosine', got "):
        check_resume_compatible(saved, load_config(None, ["run_dir=x", "optim.schedule=linear"]))
    with pytest.raises(ConfigError, match=r"'optim.t_max': .* trained with None, got 500"):
        check_resume_compatible(saved, load_config(None, ["run_dir=x", "optim.t_max=500"]))


def test_a_change_to_the_model_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="'model.overrides'") as err:
        check_resume_compatible(saved_config(), load_config(None, ["run_dir=x",
                                                                   "model.n_layers=3"]))
    assert "\n" not in str(err.value)


def test_data_seed_defaults_to_the_seed_and_is_checked():
    assert load_config(None, ["seed=7"]).data_seed == 7
    assert load_config(None, ["seed=7", "data.seed=34521"]).data_seed == 34521
    with pytest.raises(ConfigError, match=r"'data.seed': got -1, expected an integer >= 0"):
        load_config(None, ["data.seed=-1"])


def test_a_checkpoint_from_before_data_seed_existed_resumes_as_the_seeds_order():
    saved = saved_config("seed=5")
    del saved["data"]["seed"]  # a manifest's config written before the key
    assert config_from_dict(saved).data_seed == 5
    check_resume_compatible(saved, load_config(None, ["run_dir=x", "seed=5"]))
    check_resume_compatible(saved, load_config(None, ["run_dir=x", "seed=5", "data.seed=5"]))
    check_resume_compatible(saved_config("seed=5", "data.seed=5"),
                            load_config(None, ["run_dir=x", "seed=5"]))
    with pytest.raises(ConfigError, match=r"'data.seed': .* trained with 5, got 34521"):
        check_resume_compatible(saved, load_config(None, ["run_dir=x", "seed=5",
                                                          "data.seed=34521"]))
    with pytest.raises(ConfigError, match=r"'seed': .* trained with 5, got 6"):
        check_resume_compatible(saved, load_config(None, ["run_dir=x", "seed=6"]))


@pytest.mark.parametrize("overrides, needle", [
    (["data.instances=packed", "data.seq_len=48"], "'data.seq_len': got 48, but packed "
     "instances need a power of two"),
    (["data.source_group_size=8"], "expected data.instances=packed"),
    (["data.source_permutation_seed=123"], "expected data.instances=packed"),
    (["data.source_group_size=0", "data.instances=packed"], "expected >= 1"),
    (["model.document_masking=true"], "concatenated instances keep no document lengths"),
])
def test_packed_instances_and_document_masking_refuse_what_cannot_run(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["run_dir=x", *overrides])
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("layout", [
    ["parallel.pp=2"], ["parallel.pp=2", "parallel.cp=2"],
    ["parallel.pp=2", "parallel.schedule=paci", "parallel.paci.mode=mem"]])
def test_packed_instances_run_in_pipeline_stages(layout):
    """Every stage reads each micro-batch's document lengths from its own batch
    (train/pipeline_stage.py), so packed, masked instances take any pipeline layout."""
    cfg = load_config(None, ["run_dir=x", "data.instances=packed", "runtime.engine=ray",
                             *layout])
    assert cfg.document_masking and cfg.parallel.pp == 2


def test_document_masking_is_on_for_packed_instances_unless_turned_off():
    assert not load_config(None, []).document_masking
    assert load_config(None, ["data.instances=packed"]).document_masking
    assert not load_config(None, ["data.instances=packed",
                                  "model.document_masking=false"]).document_masking


def test_a_checkpoint_from_before_the_packing_keys_resumes_as_concatenated():
    saved = saved_config()
    del saved["data"]["instances"], saved["data"]["source_group_size"]
    del saved["data"]["source_permutation_seed"], saved["model"]["document_masking"]
    check_resume_compatible(saved, load_config(None, ["run_dir=x"]))
    with pytest.raises(ConfigError, match=r"'data.instances': .* 'concatenated', got 'packed'"):
        check_resume_compatible(saved, load_config(None, ["run_dir=x", "data.instances=packed"]))
def test_softmax_rows_resumes_as_the_run_settled_it_and_may_not_change():
    """Unset, `model.softmax_rows` is the run's own (settled at its start, its origin's);
    given, it must be that; a value other than tokenizer or padded is refused in one line."""
    saved = saved_config("model.softmax_rows=padded")
    assert saved["model"]["overrides"] == {"softmax_rows": "padded"}
    check_resume_compatible(saved, load_config(None, ["run_dir=x"]))
    check_resume_compatible(saved, load_config(None, ["run_dir=x", "model.softmax_rows=padded"]))
    with pytest.raises(ConfigError, match="'model.overrides'"):
        check_resume_compatible(saved, load_config(None, ["run_dir=x",
                                                          "model.softmax_rows=tokenizer"]))
    check_resume_compatible(saved_config(), load_config(None, ["run_dir=x"]))  # before the key
    with pytest.raises(ConfigError, match="model.softmax_rows") as err:
        load_config(None, ["model.softmax_rows=all"]).model_config()
    assert "\n" not in str(err.value) and "padded" in str(err.value)
