"""The reference for reading OLMo-core checkpoints: a tiny Olmo 3 built by OLMo-core's own
`TransformerConfig.olmo3_*` builder, trained by its `SkipStepAdamW` (embeddings not decayed, as
the official scripts) and saved by its own `save_model_and_optim_state` (what its trainer's
Checkpointer writes into a step directory's `model_and_optim/`), with the `config.json` its
ConfigSaverCallback writes beside it; or trained and saved whole by OLMo-core's own Trainer on
its own data loader (`train_olmo_core`: step directories with the trainer state, run as
`python -m tests.checkpoint.olmo_core_reference`); nothing of OLMo-core is re-implemented
here. Importers skip themselves first where ai2-olmo-core is not installed
(`pytest.importorskip("olmo_core.nn.transformer")`)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from olmo_core.distributed.checkpoint import save_model_and_optim_state
from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig

from relaytrain.checkpoint import olmo_core
from relaytrain.checkpoint.keys import model_key, optim_key
from relaytrain.checkpoint.olmo_core import DCP_DIR, MOMENTS, olmo_core_to_ours_name
from relaytrain.model.config import Olmo3Config

VOCAB, SEQ, WINDOW = 256, 16, 6
LR, BETAS, WD = 3e-4, (0.9, 0.95), 0.1  # the Olmo 3 recipe's AdamW
STEPS = 2  # optimizer steps before the save: non-zero moments, step count 2
# OLMo-core's olmo3_1M with grouped-query attention (4 heads of 4, 2 kv heads, d_model 12)
OURS = Olmo3Config(d_model=12, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=4, mlp_hidden=256,
                   vocab_size=VOCAB, rms_eps=1e-6, rope_theta=500_000.0, sliding_window=WINDOW)
DIMENSIONS = {"d_model": 12, "vocab_size": VOCAB, "n_layers": 4, "mlp_hidden": 256,
              "n_heads": 4, "n_kv_heads": 2, "head_dim": 4}
# OURS as a run's `model.*` overrides (its vocabulary: the run's data's, padded)
# (rms_eps spelt with a point: YAML reads a bare 1e-06 as a string)
RUN_MODEL = (*(f"model.{f}={getattr(OURS, f)}" for f in (
    "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "rope_theta",
    "sliding_window")), "model.rms_eps=1.0e-6")


def olmo_core_model(shard: Any = None, vocab: int = VOCAB) -> tuple[Any, torch.nn.Module, Any]:
    """OLMo-core's config, model and optimizer, built as its trainer builds them (CPU, fp32);
    sharded over the device mesh `shard` by its own `apply_fsdp` if given."""
    cfg = TransformerConfig.olmo3_1M(
        vocab_size=vocab, n_kv_heads=2, attn_backend=AttentionBackendName.torch,
        sliding_window=SlidingWindowAttentionConfig(  # Olmo 3's pattern, a window under SEQ
            pattern=[WINDOW, WINDOW, WINDOW, -1], force_full_attention_on_first_layer=False,
            force_full_attention_on_last_layer=True))
    model = cfg.build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    if shard is not None:
        model.apply_fsdp(dp_mesh=shard)
    optim = SkipStepAdamWConfig(
        lr=LR, betas=BETAS, weight_decay=WD,
        group_overrides=[OptimGroupOverride(params=["embeddings.weight"],
                                            opts={"weight_decay": 0.0})]).build(model)
    return cfg, model, optim


def olmo_core_step(model: torch.nn.Module, optim: Any, ids: torch.Tensor) -> torch.Tensor:
    """One training step as OLMo-core's train module takes it: its loss, backward, step."""
    loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
    loss.backward()
    optim.latest_loss = loss.detach()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@dataclass
class Saved:
    step_dir: Path  # OLMo-core's stepN/ (config.json, model_and_optim/)
    model: torch.nn.Module
    optim: Any
    batch: torch.Tensor  # the batch of the step after the checkpoint


def save_olmo_core(out: Path, vocab: int = VOCAB, tokens: int = VOCAB) -> Saved:
    """OLMo-core's model of `vocab` rows trained STEPS steps on random ids under `tokens`,
    saved as its trainer saves it in `out/stepSTEPS/`."""
    torch.manual_seed(0)
    cfg, model, optim = olmo_core_model(vocab=vocab)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        olmo_core_step(model, optim, torch.randint(0, tokens, (2, SEQ + 1), generator=g))
    step_dir = out / f"step{STEPS}"
    with warnings.catch_warnings():  # one process: OLMo-core's save says so
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        save_model_and_optim_state(step_dir / DCP_DIR, model, optim)
    # what OLMo-core's ConfigSaverCallback writes beside each checkpoint
    (step_dir / "config.json").write_text(json.dumps({"model": cfg.as_config_dict()}))
    return Saved(step_dir, model, optim, torch.randint(0, tokens, (2, SEQ + 1), generator=g))


def assert_equal_to_olmo_core(tensors: dict[str, torch.Tensor], saved: Saved,
                              optimizer: bool) -> None:
    """Every weight (and moment) bit-equal to OLMo-core's own, mapped by name, nothing else."""
    expected = set()
    for name, p in saved.model.named_parameters():
        ours = olmo_core_to_ours_name(name)
        expected.add(model_key(ours))
        assert torch.equal(tensors[model_key(ours)], p.detach()), name
        if optimizer:
            state = saved.optim.state[p]
            for m in MOMENTS:
                t = tensors[optim_key(ours, m)]
                assert t.dtype == torch.float32 and torch.equal(t, state[m]), (name, m)
            step = tensors[optim_key(ours, "step")]
            assert step.dtype == torch.float32 and step.shape == () and step.item() == STEPS
            expected |= {optim_key(ours, s) for s in (*MOMENTS, "step")}
    assert set(tensors) == expected


def counting_chunk_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The chunks read from here on (the file each lies in), as they are read."""
    reads: list[str] = []
    real = olmo_core._read_chunk

    def counted(fs: Any, dcp: str, info: Any, where: str) -> torch.Tensor:
        reads.append(info.relative_path)
        return real(fs, dcp, info, where)

    monkeypatch.setattr(olmo_core, "_read_chunk", counted)
    return reads


# OLMo-core's own Trainer (`train_olmo_core`): a token file of ids under VOCAB, documents ending
# in EOS_ID, cut into instances of SEQ tokens, TRAIN_BATCH of them a step, in its data loader's
# order of DATA_SEED, a cosine of TRAIN_WARMUP steps to alpha_f 0.1 at its last step
EOS_ID, PAD_ID, DATA_SEED, TRAIN_BATCH, TRAIN_WARMUP = 0, 1, 34521, 2, 1


def write_token_file(path: Path, n_tokens: int = 4000) -> None:
    rng = np.random.default_rng(0)
    toks = rng.integers(2, VOCAB, size=n_tokens)
    toks[rng.choice(n_tokens, size=n_tokens // 40, replace=False)] = EOS_ID
    toks[-1] = EOS_ID
    toks.astype("<u4").tofile(path)


def olmo_core_loader(token_file: Path, work_dir: Path) -> Any:
    """OLMo-core's own dataset and data loader over `token_file`."""
    from olmo_core import data as od

    dataset = od.NumpyFSLDataset(str(token_file), sequence_length=SEQ, pad_token_id=PAD_ID,
                                 eos_token_id=EOS_ID, vocab_size=VOCAB, dtype=np.uint32)
    dataset.work_dir = work_dir
    dataset.prepare()
    return od.NumpyDataLoaderBase.wrap_numpy_dataset(
        dataset, global_batch_size=TRAIN_BATCH * SEQ, collator=od.DataCollator(
            pad_token_id=PAD_ID), work_dir=work_dir, seed=DATA_SEED, dp_world_size=1,
        dp_rank=0, fs_local_rank=0, num_threads=0)


def train_olmo_core(token_file: Path, out: Path, steps: int) -> None:
    """`steps` steps of OLMo-core's Trainer (its TransformerTrainModule, SkipStepAdamW,
    CosWithWarmup), a checkpoint of every step in `out/stepN/` written by its Checkpointer:
    `model_and_optim/` and the trainer state `train/rank0.pt`."""
    from olmo_core.optim import CosWithWarmup
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import CheckpointerCallback
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    torch.manual_seed(0)
    _, model, _ = olmo_core_model()
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=TRAIN_BATCH * SEQ, max_sequence_length=SEQ,
        optim=SkipStepAdamWConfig(lr=LR, betas=BETAS, weight_decay=WD, group_overrides=[
            OptimGroupOverride(params=["embeddings.weight"], opts={"weight_decay": 0.0})]),
        scheduler=CosWithWarmup(warmup=TRAIN_WARMUP)).build(model, device=torch.device("cpu"))
    trainer = TrainerConfig(
        save_folder=str(out), work_dir=str(out / "work"), max_duration=Duration.steps(steps),
        metrics_collect_interval=1, cancel_check_interval=1).with_callback(
        "checkpointer", CheckpointerCallback(save_interval=1, ephemeral_save_interval=None,
                                             save_async=False)).build(
        module, olmo_core_loader(token_file, out / "work"))
    with warnings.catch_warnings():  # one process: OLMo-core's save says so
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        trainer.fit()


if __name__ == "__main__":
    import sys

    train_olmo_core(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
