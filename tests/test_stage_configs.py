"""The stage configs (configs/olmo3-*-*.yaml) against OLMo-core's official Olmo 3 scripts
(allenai/OLMo-core, src/scripts/official/OLMo3/): the scripts' values kept here as data, in the
scripts' own terms (tokens per batch, scheduler classes, callbacks), and what each means in
relaytrain's keys derived here, so a config that drifts from its script fails. The model's
dimensions come from ai2-olmo-core's builders, run here (tests/model/test_presets.py compares
every field of the presets); the schedulers' defaults (`alpha_f`) from OLMo-core's classes.

What a script sets that relaytrain has no key for must be named in the config's comments
(`no_key`): the test reads the YAML's text for each name."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("olmo_core")

from olmo_core.data import DataMix, TokenizerConfig  # noqa: E402
from olmo_core.nn.rope import RotaryEmbedding, YaRNRoPEScalingConfig  # noqa: E402
from olmo_core.nn.transformer import TransformerConfig  # noqa: E402
from olmo_core.optim import CosWithWarmup, HalfCosWithWarmup, LinearWithWarmup  # noqa: E402

from relaytrain.bench.gpu import GPU_80GB, memory_plan
from relaytrain.config import load_config
from relaytrain.model.config import PRESETS  # noqa: E402
from relaytrain.model.olmo3 import rope_cos_sin  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SCRIPTS = "src/scripts/official/OLMo3/"
V3_SMALL = "v3_small_ppl_validation"
EVAL_TASKS = "DownstreamEvaluatorCallbackConfig"  # OLMES tasks: no key

# Each script as read at allenai/OLMo-core@commit. Units are the scripts': batch sizes in tokens,
# durations as OLMo-core's Duration (unit, value).
OFFICIAL = {
    "olmo3-7b-pretrain-1.yaml": {
        "script": SCRIPTS + "OLMo-3-1025-7B-pretrain-1.py",
        "commit": "18b8fb66b9840a041c603acf7c7dd18b881229d8",
        "builder": "olmo3_7B", "init_seed": 12536,  # ExperimentConfig's default, not overridden
        "sequence_length": 8192, "global_batch_size": 8192 * 512, "data_seed": 34521,
        "rank_microbatch_size": 2 * 8192,
        "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
        "embeddings_weight_decay": 0.0, "skip_step": (128, 6.0),  # SkipStepAdamWConfig defaults
        "scheduler": CosWithWarmup(warmup=2000),
        "max_duration": ("tokens", int(5e12)), "hard_stop": ("steps", 597046),
        "z_loss_multiplier": 1e-5, "max_grad_norm": 1.0, "compile_model": True,
        "param_dtype": "bfloat16", "reduce_dtype": "float32", "shard_degree": None,
        "ac": None, "lm_eval": (V3_SMALL, 10_000), "save_interval": 1000,
        "load_path": None, "load_optim_state": False,
        "no_key": [EVAL_TASKS, "hard_stop"],
    },
    "olmo3-7b-pretrain-2.yaml": {
        "script": SCRIPTS + "OLMo-3-1025-7B-pretrain-2.py",
        "commit": "138b1fca4992c704f320c05718ef8168ffb44ea1",
        "builder": "olmo3_7B", "init_seed": 12536,
        "sequence_length": 8192, "global_batch_size": 8192 * 512, "data_seed": 34521,
        "rank_microbatch_size": 2 * 8192,
        "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
        "embeddings_weight_decay": 0.0, "skip_step": (128, 6.0),  # SkipStepAdamWConfig defaults
        # original_max_steps // 2 + original_warmup_steps // 2, on the resumed step count
        "scheduler": HalfCosWithWarmup(warmup=int(5e12) // (8192 * 512) // 2 + 2000 // 2),
        "max_duration": ("tokens", int(7e12)), "hard_stop": ("epochs", 1),
        # the epoch ended at the step 7B mid-training loads (its load_path): stage1/step1413814
        "epoch_end_step": 1413814, "load_step": 596047,
        "z_loss_multiplier": 1e-5, "max_grad_norm": 1.0, "compile_model": True,
        "param_dtype": "bfloat16", "reduce_dtype": "float32", "shard_degree": None,
        "ac": None, "lm_eval": (V3_SMALL, 10_000), "save_interval": 1000,
        "load_path": "https://storage.googleapis.com/ai2-llm/checkpoints/OLMo25/step596047/",
        "load_optim_state": True, "load_trainer_state": True,
        "no_key": [EVAL_TASKS],
    },
    "olmo3-7b-midtrain.yaml": {
        "script": SCRIPTS + "OLMo-3-1025-7B-midtrain.py",
        "commit": "60f7eb8a29e6f305fa3b15c0ab6431ac28661c20",
        "builder": "olmo3_7B", "init_seed": 1337,
        "sequence_length": 8192, "global_batch_size": 2**21, "data_seed": 1337,
        "rank_microbatch_size": 2 * 8192,
        "lr": 0.00020712352850360292, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
        "embeddings_weight_decay": 0.0, "skip_step": (128, 6.0),  # SkipStepAdamWConfig defaults
        "scheduler": LinearWithWarmup(warmup=0, alpha_f=0.0),
        "max_duration": ("tokens", 100_000_000_000), "hard_stop": None,
        "z_loss_multiplier": 1e-5, "max_grad_norm": 1.0, "compile_model": True,
        "param_dtype": "bfloat16", "reduce_dtype": "float32", "shard_degree": None,
        "ac": ("selected_modules", ["blocks.*.feed_forward"]), "lm_eval": None,
        "save_interval": 1000, "ephemeral_save_interval": 100,
        "load_path": "https://olmo-checkpoints.org/ai2-llm/Olmo-3-1025-7B/stage1/step1413814/",
        "load_optim_state": True, "load_trainer_state": False,
        "no_key": ["selected_modules", "ephemeral_save_interval"],
    },
    "olmo3-32b-pretrain.yaml": {
        "script": SCRIPTS + "OLMo-3-1025-32B-pretrain.py",
        "commit": "09042a6d7bf702fb37298dbacd94cf6c5f3c91ce",
        "builder": "olmo3_32B", "init_seed": 12536,
        "sequence_length": 8192, "global_batch_size": 8 * 1024 * 1024, "data_seed": 34521,
        "rank_microbatch_size": 8192,
        "lr": 6e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
        "embeddings_weight_decay": 0.0, "skip_step": (128, 6.0),  # SkipStepAdamWConfig defaults
        "scheduler": CosWithWarmup(warmup=2000),
        # One epoch of the mix: its length is the data's. The README's 5.50T tokens end at
        # step 656000, the checkpoint 32B mid-training loads (stego32-highlr-filter3/step656000).
        "max_duration": ("epochs", 1), "hard_stop": None, "epoch_end_step": 656000,
        "z_loss_multiplier": 1e-5, "max_grad_norm": 1.0, "compile_model": True,
        "param_dtype": "bfloat16", "reduce_dtype": "float32", "shard_degree": 64,
        "ac": None, "lm_eval": (V3_SMALL, 1000), "save_interval": 1000,
        "load_path": None, "load_optim_state": False,
        "no_key": [EVAL_TASKS, "InstanceFilterConfig"],
    },
    "olmo3-32b-midtrain.yaml": {
        "script": SCRIPTS + "OLMo-3-1025-32B-midtrain.py",
        "commit": "47f1e52bebaebd7eb61dae36f996b8304f2d2011",
        "builder": "olmo3_32B", "init_seed": 12536,
        "sequence_length": 8192, "global_batch_size": 4 * 1024 * 1024, "data_seed": 1337,
        "rank_microbatch_size": 8192,
        "lr": 0.0002071235285, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
        "embeddings_weight_decay": 0.0, "skip_step": (128, 6.0),  # SkipStepAdamWConfig defaults
        "scheduler": LinearWithWarmup(warmup=0, alpha_f=0.0),
        "max_duration": ("tokens", 100_000_000_000), "hard_stop": None,
        "z_loss_multiplier": 1e-5, "max_grad_norm": 1.0, "compile_model": True,
        "param_dtype": "bfloat16", "reduce_dtype": "float32", "shard_degree": 64,
        "ac": ("budget", 0.5), "lm_eval": None, "save_interval": 1000,
        "load_path": "https://olmo-checkpoints.org/ai2-llm/stego32-highlr-filter3/step656000/",
        "load_optim_state": True, "load_trainer_state": False,
        "no_key": ["InstanceFilterConfig", "activation_memory_budget"],
    },
    # Stage 3: YaRN (factor, beta_fast, beta_slow, old_context_len), packed instances
    # (source_group_size, source_permutation_seed) with doc lengths, context parallelism
    # (degree, head_stride): parallel.cp.
    "olmo3-7b-long-context.yaml": {
        "script": SCRIPTS + "OLMo-3-1025-7B-long-context.py",
        "commit": "138b1fca4992c704f320c05718ef8168ffb44ea1",
        "builder": "olmo3_7B", "init_seed": 12536,
        "sequence_length": 65536, "global_batch_size": 65536 * 64, "data_seed": 34521,
        "rank_microbatch_size": 65536,
        "yarn": (8, 32, 1, 8192), "packed": (8, 123), "cp": (8, 4),
        "lr": 0.00020712352850360292, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
        "embeddings_weight_decay": 0.0, "skip_step": (128, 6.0),  # SkipStepAdamWConfig defaults
        "scheduler": LinearWithWarmup(warmup=200, alpha_f=0.0),
        "max_duration": ("tokens", int(5e12)), "hard_stop": ("steps", 597046),
        "z_loss_multiplier": 1e-5, "max_grad_norm": 1.0, "compile_model": True,
        "param_dtype": "bfloat16", "reduce_dtype": "float32", "shard_degree": 1,
        "ac": None, "lm_eval": None, "save_interval": 1000,
        "load_path": "https://olmo-checkpoints.org/ai2-llm/Olmo-3-1025-7B/stage2/step47684/",
        "load_optim_state": True, "load_trainer_state": False,
        "no_key": ["Float8Config", "hard_stop", "TransformerContextParallelConfig"],
    },
    "olmo3-32b-long-context.yaml": {
        "script": SCRIPTS + "OLMo-3-1025-32B-long-context.py",
        "commit": "00e2b7b842e72ff636767be003d5f1e6cb516718",
        "builder": "olmo3_32B", "init_seed": 12536,
        "sequence_length": 65536, "global_batch_size": 8 * 1024 * 1024, "data_seed": 34521,
        "rank_microbatch_size": 65536,
        "yarn": (8, 32, 1, 8192), "packed": (8, 123), "cp": (8, 4),
        "lr": 0.0002071235285, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
        "embeddings_weight_decay": 0.0, "skip_step": (128, 6.0),  # SkipStepAdamWConfig defaults
        "scheduler": LinearWithWarmup(warmup=200, alpha_f=0.0),
        "max_duration": ("tokens", 100_000_000_000), "hard_stop": None,
        "z_loss_multiplier": 1e-5, "max_grad_norm": 1.0, "compile_model": True,
        "param_dtype": "bfloat16", "reduce_dtype": "float32", "shard_degree": 8,
        "ac": ("budget", 0.3), "lm_eval": None, "save_interval": 1000,
        "load_path": "https://storage.googleapis.com/ai2-llm/checkpoints/"
                     "stego32-highlr-filter3/step656000/",
        "load_optim_state": True, "load_trainer_state": False,
        "no_key": ["InstanceFilterConfig", "activation_memory_budget",
                   "TransformerContextParallelConfig"],
    },
}
PRESET = {"olmo3_7B": "olmo3-7b", "olmo3_32B": "olmo3-32b"}
SCHEDULE = {CosWithWarmup: "cosine", LinearWithWarmup: "linear",
            HalfCosWithWarmup: "half-cosine"}


def steps(script: dict) -> tuple[int, int | None]:
    """(train.max_steps, optim.t_max) as OLMo-core's trainer counts them: max_duration in tokens
    is ceil(tokens / tokens per step) steps, the schedule's horizon; a hard stop ends it early.
    A run that loaded a step with its trainer state goes on counting from it (as relaytrain's
    init.trainer_state); without, relaytrain counts from 0."""
    unit, value = script["max_duration"]
    horizon = math.ceil(value / script["global_batch_size"]) if unit == "tokens" else None
    stop = script["hard_stop"]
    if unit == "epochs" or (stop and stop[0] == "epochs"):
        carried = script.get("load_trainer_state")
        end = script["epoch_end_step"] - (0 if carried else script.get("load_step", 0))
        return end, horizon
    if stop:
        return stop[1], horizon
    return horizon, None


def expected(script: dict) -> dict:
    """relaytrain's keys for a script's values."""
    seq, sched = script["sequence_length"], script["scheduler"]
    max_steps, t_max = steps(script)
    assert script["global_batch_size"] % seq == 0 and script["rank_microbatch_size"] % seq == 0
    out = {
        "model.preset": PRESET[script["builder"]], "seed": script["init_seed"],
        "data.seed": script["data_seed"], "data.seq_len": seq, "data.order": "olmo-core",
        "train.global_batch": script["global_batch_size"] // seq,
        "train.micro_batch": script["rank_microbatch_size"] // seq,
        "train.max_steps": max_steps,
        "train.z_loss": script["z_loss_multiplier"], "train.clip": script["max_grad_norm"],
        "optim.lr": script["lr"], "optim.betas": script["betas"], "optim.eps": script["eps"],
        "optim.weight_decay": script["weight_decay"],
        "optim.decay_embeddings": script["embeddings_weight_decay"] == script["weight_decay"],
        "optim.final_lr_frac": sched.alpha_f,
        "optim.skip_spikes": script["skip_step"] is not None,
        "optim.skip_window": script["skip_step"][0], "optim.skip_sigma": script["skip_step"][1],
        "parallel.fsdp_param_dtype": {"bfloat16": "bf16", "float32": "fp32"}[
            script["param_dtype"]],
        "parallel.fsdp": script["shard_degree"] or 1,
        # relaytrain has no per-module or budget checkpointing: full, the nearest that saves
        # at least as much memory, where the script checkpoints anything
        "model.checkpointing": "full" if script["ac"] else "none",
        "model.compile": "blocks" if script["compile_model"] else "none",
        "eval.every": script["lm_eval"][1] if script["lm_eval"] else 0,
        "checkpoint.every": script["save_interval"],
        "init.from_": script["load_path"], "init.optimizer": script["load_optim_state"],
        "data.instances": "packed" if script.get("packed") else "concatenated",
        "data.source_group_size": script["packed"][0] if script.get("packed") else 1,
        "data.source_permutation_seed": script["packed"][1] if script.get("packed") else None,
        "document_masking": bool(script.get("packed")),  # generate_doc_lengths=True
        "init.trainer_state": script.get("load_trainer_state", False),
    }
    assert script["reduce_dtype"] == "float32"  # relaytrain reduces in fp32 always
    if type(sched) in SCHEDULE:
        out.update({"optim.schedule": SCHEDULE[type(sched)], "optim.warmup": sched.warmup,
                    "optim.t_max": t_max})
    return out


def value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return tuple(cfg) if isinstance(cfg, list) else cfg


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_each_stage_config_holds_its_scripts_values(name):
    script, path = OFFICIAL[name], CONFIGS / name
    cfg = load_config(path, [])  # validation passes here (train.device: cuda is a choice)
    want = expected(script)
    assert {k: value(cfg, k) for k in want} == want
    text = path.read_text()
    assert script["script"] in text  # the config names its script
    assert [n for n in script["no_key"] if n not in text] == []  # named in a comment
    if script.get("cp"):
        degree, stride = script["cp"]
        assert f"degree={degree}, head_stride={stride}" in text
        assert cfg.parallel.cp == degree
    sets = DataMix.v3_small_ppl_validation.build("", TokenizerConfig.dolma2().identifier)[1]
    if script["lm_eval"]:
        assert script["lm_eval"][0] == V3_SMALL and list(cfg.eval.sets) == sets
        assert all(p.endswith("/" + n) for n, p in cfg.eval.sets.items())
    else:
        assert cfg.eval.sets == {}


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_each_stage_model_is_the_scripts_builder(name):
    builder = getattr(TransformerConfig, OFFICIAL[name]["builder"])
    theirs = builder(vocab_size=TokenizerConfig.dolma2().padded_vocab_size())
    attn, ffn = theirs.block.sequence_mixer, theirs.block.feed_forward
    cfg = load_config(CONFIGS / name, [])
    m = cfg.model_config()
    # the preset whole, its loss OLMo-core's (the softmax over every padded row: the model's
    # `lm_head.w_out` has vocab_size rows, all of them logits), no other override but the
    # script's YaRN, as OLMo-core hands it to HF
    assert {k: v for k, v in cfg.model.overrides.items() if k != "rope_scaling"} == \
        {"softmax_rows": "padded"}
    assert m == dataclasses.replace(PRESETS[cfg.model.preset], softmax_rows="padded",
                                    rope_scaling=yarn_of(name))
    assert theirs.vocab_size == m.vocab_size > m.tokenizer_vocab
    assert (m.d_model, m.n_layers, m.vocab_size, m.n_heads, m.n_kv_heads, m.mlp_hidden,
            m.rope_theta, m.rms_eps, m.sliding_window) == \
        (theirs.d_model, theirs.n_layers, theirs.vocab_size, attn.n_heads,
         attn.n_kv_heads or attn.n_heads,  # OLMo-core's None: as many as the heads
         ffn.hidden_size, attn.rope.theta, theirs.block.layer_norm.eps,
         max(attn.sliding_window.pattern))


def yarn_of(name: str) -> dict | None:
    """The script's YaRN in HF's terms (OLMo-core's own `to_hf_config`), or None; its
    attention factor is the default the model computes (0.1 ln(factor) + 1), left implicit."""
    if not OFFICIAL[name].get("yarn"):
        return None
    factor, fast, slow, old = OFFICIAL[name]["yarn"]
    hf = YaRNRoPEScalingConfig(factor=factor, beta_fast=fast, beta_slow=slow,
                               old_context_len=old).to_hf_config()
    assert hf.pop("rope_type") == "yarn"
    assert hf.pop("attention_factor") == 0.1 * math.log(factor) + 1.0
    return hf


@pytest.mark.parametrize("name", [n for n in sorted(OFFICIAL) if OFFICIAL[n].get("yarn")])
def test_each_long_context_models_yarn_tables_are_olmo_cores_to_the_bit(name):
    """Full layers' RoPE at every position of the script's sequence length, against
    OLMo-core's RotaryEmbedding with the script's YaRNRoPEScalingConfig."""
    factor, fast, slow, old = OFFICIAL[name]["yarn"]
    m = load_config(CONFIGS / name, []).model_config()
    seq = OFFICIAL[name]["sequence_length"]
    rope = RotaryEmbedding(head_size=m.head_dim, theta=int(m.rope_theta),
                           scaling=YaRNRoPEScalingConfig(factor=factor, beta_fast=fast,
                                                         beta_slow=slow, old_context_len=old))
    sin, cos = rope._get_rotary_embedding(seq, torch.device("cpu"))
    my_cos, my_sin = rope_cos_sin(m, True, seq, torch.device("cpu"))
    assert torch.equal(my_cos, cos) and torch.equal(my_sin, sin)


def test_the_32b_long_context_layout_fits_80_gb_gpus_at_65536_tokens():
    """fsdp 8 x cp 8: a replica's state sharded over its 64 GPUs (cp ranks shard it too,
    parallel/groups.py), each holding 1/8 of every sequence: the memory plan's peak fits an
    80 GB GPU, with the config's bf16 gathers and with exact mode's fp32 ones."""
    cfg = load_config(CONFIGS / "olmo3-32b-long-context.yaml", [])
    p = cfg.parallel
    assert (cfg.seq_len, cfg.train.micro_batch, p.fsdp, p.cp, p.shards) == (65_536, 1, 8, 8, 64)
    assert_fits_80_gb(cfg)
    # sharded over fsdp alone, each cp rank holding its replica's whole state, it would not
    assert memory_plan(cfg.model_config(), cfg.seq_len, 1, fsdp=p.fsdp, cp=p.cp)["peak"] > \
        GPU_80GB


def test_the_7b_long_context_layout_fits_80_gb_gpus_at_65536_tokens():
    """fsdp 1 x cp 8 with parallel.shard_over_cp (OLMo-core's hsdp shard_degree=1 with cp 8):
    a replica's state sharded over its 8 cp GPUs, each holding 1/8 of every sequence. Without
    activation checkpointing, as the script (ac_config=None) and the config: the plan keeps
    every block's activations, and its peak fits an 80 GB GPU in fast mode; exact mode (fp32
    gathers and residual stream, limb sums) fits only with model.checkpointing=full."""
    cfg = load_config(CONFIGS / "olmo3-7b-long-context.yaml", [])
    p = cfg.parallel
    assert (cfg.seq_len, cfg.train.micro_batch, p.fsdp, p.cp, p.shards) == (65_536, 1, 1, 8, 8)
    assert cfg.model.checkpointing == "none"
    assert_fits_80_gb(cfg, exact_modes=(False,))
    exact = {ac: plan(cfg, exact=True, checkpointing=ac)["peak"] for ac in ("none", "full")}
    assert exact["none"] > GPU_80GB > exact["full"]
    # unsharded, each cp rank holding the whole 7B state, it would not
    assert memory_plan(cfg.model_config(), cfg.seq_len, 1, fsdp=1, cp=p.cp)["peak"] > GPU_80GB


def plan(cfg, exact: bool, **kwargs) -> dict:
    """The memory plan of the config's layout and gathers (exact mode's fp32), its
    activation checkpointing unless `kwargs` say otherwise."""
    p = cfg.parallel
    return memory_plan(cfg.model_config(), cfg.seq_len, cfg.train.micro_batch, fsdp=p.shards,
                       exact=exact, cp=p.cp, gather="auto" if exact else p.fsdp_param_dtype,
                       **{"checkpointing": cfg.model.checkpointing, **kwargs})


def assert_fits_80_gb(cfg, exact_modes=(False, True)) -> None:
    """The memory plan's peak at the config's shards and activation checkpointing, with its
    gathers (fast mode) and with exact mode's fp32 ones, is under 80 GB."""
    for exact in exact_modes:
        assert plan(cfg, exact)["peak"] < GPU_80GB, (exact, plan(cfg, exact)["peak"])
