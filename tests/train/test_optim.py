"""AdamW as the Olmo recipe builds it, and the learning-rate schedule: linear warm-up to `lr`,
cosine (or linear, or a cosine's second half) to `lr * final_lr_frac` at `max_steps` (or
`t_max`), flat after: OLMo-core's schedulers."""

import math
import subprocess
import sys

import pytest
import torch

from relaytrain.checkpoint.keys import optim_key
from relaytrain.config.sections import OptimSection
from relaytrain.model.config import PRESETS
from relaytrain.model.init import init_weights
from relaytrain.model.olmo3 import Olmo3
from relaytrain.train.optim import (
    AdamW,
    build_optimizer,
    load_optimizer_state,
    lr_at,
    optimizer_state_tensors,
    set_lr,
)

CFG = OptimSection(lr=1e-3, warmup=10, final_lr_frac=0.1)
MAX_STEPS = 110  # 100 cosine steps after the warm-up


# --- the schedule ----------------------------------------------------------------------------

def test_warm_up_is_linear_and_reaches_lr_at_its_last_step():
    assert [lr_at(s, CFG, MAX_STEPS) for s in (1, 5, 10)] == \
        pytest.approx([1e-4, 5e-4, 1e-3], rel=1e-12)


def test_cosine_from_lr_to_the_final_fraction_at_max_steps():
    floor = CFG.lr * CFG.final_lr_frac
    assert lr_at(11, CFG, MAX_STEPS) == pytest.approx(
        floor + (CFG.lr - floor) * 0.5 * (1 + math.cos(math.pi / 100)), rel=1e-12)
    assert lr_at(60, CFG, MAX_STEPS) == pytest.approx((CFG.lr + floor) / 2, rel=1e-12)
    assert lr_at(MAX_STEPS, CFG, MAX_STEPS) == pytest.approx(floor, rel=1e-12)
    after = [lr_at(s, CFG, MAX_STEPS) for s in range(10, MAX_STEPS + 1)]
    assert all(b < a for a, b in zip(after, after[1:], strict=False))


def test_flat_at_the_floor_past_max_steps():
    floor = CFG.lr * CFG.final_lr_frac
    assert lr_at(MAX_STEPS + 1, CFG, MAX_STEPS) == lr_at(10 * MAX_STEPS, CFG, MAX_STEPS) == \
        pytest.approx(floor, rel=1e-12)


def test_no_warm_up_starts_at_lr_and_final_fraction_one_is_constant():
    cold = OptimSection(lr=2e-3, warmup=0, final_lr_frac=0.0)
    assert lr_at(0, cold, 50) == 2e-3 and lr_at(50, cold, 50) == pytest.approx(0.0, abs=1e-18)
    flat = OptimSection(lr=2e-3, warmup=3, final_lr_frac=1.0)
    assert {lr_at(s, flat, 50) for s in range(3, 60)} == {2e-3}


def test_a_run_shorter_than_its_warm_up_never_divides_by_zero():
    assert lr_at(5, CFG, 5) == pytest.approx(5e-4, rel=1e-12)
    assert lr_at(11, CFG, 10) == pytest.approx(CFG.lr * CFG.final_lr_frac, rel=1e-12)


# The schedules against OLMo-core's own classes (`olmo_core.optim.scheduler`), run here: the
# trainer calls `get_lr(initial_lr, global_step, t_max)` with the 1-based step of the update,
# and t_max the trainer's max steps unless the scheduler has its own.
SCHEDULES = [  # (schedule, lr, warmup, alpha_f, train.max_steps, optim.t_max)
    ("cosine", 3e-4, 2000, 0.1, 12_000, None),
    ("cosine", 6e-4, 20, 0.1, 150, 400),  # stopped early: the horizon is the planned length
    ("cosine", 1e-3, 0, 0.0, 90, None),
    ("linear", 2.0712352850360292e-4, 0, 0.0, 4_000, None),  # the mid-training stages'
    ("linear", 1e-3, 50, 0.1, 300, None),
    ("linear", 1e-3, 7, 0.25, 60, 80),
    # the 7B pre-training's part 2, scaled down: warm-up to the midpoint over the steps part 1
    # took, the second half after, on the resumed step count (t_max its extended length)
    ("half-cosine", 3e-4, 597, 0.1, 1414, 1669),
    ("half-cosine", 1e-3, 40, 0.25, 200, None),
    ("half-cosine", 1e-3, 0, 0.0, 90, None),
]
OLMO_CORE = {"cosine": "CosWithWarmup", "linear": "LinearWithWarmup",
             "half-cosine": "HalfCosWithWarmup"}


@pytest.mark.parametrize(("schedule", "lr", "warmup", "alpha_f", "max_steps", "t_max"), SCHEDULES)
def test_the_schedules_are_olmo_cores(schedule, lr, warmup, alpha_f, max_steps, t_max):
    scheduler = pytest.importorskip("olmo_core.optim.scheduler")
    theirs = getattr(scheduler, OLMO_CORE[schedule])(warmup=warmup, alpha_f=alpha_f,
                                                     t_max=t_max)
    cfg = OptimSection(lr=lr, warmup=warmup, schedule=schedule, final_lr_frac=alpha_f,
                       t_max=t_max)
    horizon = t_max or max_steps
    steps = sorted({*range(1, min(horizon, 3 * warmup + 50)), *range(1, horizon + 20, 7),
                    warmup, warmup + 1, horizon - 1, horizon, horizon + 1, 3 * horizon} - {0})
    for step in steps:
        assert lr_at(step, cfg, max_steps) == pytest.approx(
            theirs.get_lr(lr, step, max_steps), rel=1e-12, abs=1e-20), step


# --- the optimizer ---------------------------------------------------------------------------

def tiny_model() -> Olmo3:
    model = Olmo3(PRESETS["tiny"].with_vocab(60))
    init_weights(model, 0)
    return model


def test_embeddings_are_not_decayed_unless_asked_everything_else_is():
    model = tiny_model()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimSection(weight_decay=0.1))
    groups = [({names[id(p)] for p in g["params"]}, g["weight_decay"]) for g in opt.param_groups]
    assert groups == [(set(names.values()) - {"embed.weight"}, 0.1), ({"embed.weight"}, 0.0)]
    opt = build_optimizer(model, OptimSection(weight_decay=0.1, decay_embeddings=True))
    assert [(len(g["params"]), g["weight_decay"]) for g in opt.param_groups] == \
        [(len(names), 0.1)]


def test_frozen_parameters_are_left_out():
    model = tiny_model()
    model.embed.weight.requires_grad_(False)
    opt = build_optimizer(model, OptimSection())
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(model.embed.weight) not in held and len(opt.param_groups) == 1


def test_the_configured_hyperparameters_and_set_lr():
    opt = build_optimizer(tiny_model(), OptimSection(lr=3e-4, betas=(0.9, 0.99), eps=1e-6))
    assert {(g["lr"], g["betas"], g["eps"]) for g in opt.param_groups} == \
        {(3e-4, (0.9, 0.99), 1e-6)}
    set_lr(opt, 5e-5)
    assert {g["lr"] for g in opt.param_groups} == {5e-5}


def test_the_same_bits_and_state_as_torch_s_fused_adamw():
    """Ours drives the kernel torch.optim.AdamW(fused=True) runs: every weight and moment equal,
    over steps with a changing learning rate and both parameter groups."""
    cfg = OptimSection(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    model, twin = tiny_model(), tiny_model()
    ours = build_optimizer(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    twin_params = dict(twin.named_parameters())
    theirs = torch.optim.AdamW(
        [{"params": [twin_params[names[id(p)]] for p in g["params"]],
          "weight_decay": g["weight_decay"]} for g in ours.param_groups],
        lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    for step in range(1, 4):
        set_lr(ours, cfg.lr / step)
        set_lr(theirs, cfg.lr / step)
        _train_step(model, ours, step)
        _train_step(twin, theirs, step)
    for name, p in model.named_parameters():
        q = twin_params[name]
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours.state[p][key], theirs.state[q][key]), (name, key)
            assert ours.state[p][key].dtype == theirs.state[q][key].dtype


def test_a_training_step_imports_neither_the_compiler_nor_fsdp():
    """Both cost seconds of every worker's start and of every replacement's (README
    "Recovery"): torch.optim's first use imports torch._dynamo; FSDP2 is for sharded runs."""
    code = (
        "import sys, torch\n"
        "from relaytrain.runtime import worker\n"
        "from relaytrain.model.config import PRESETS\n"
        "from relaytrain.model.olmo3 import Olmo3\n"
        "from relaytrain.config.sections import OptimSection\n"
        "from relaytrain.train.optim import build_optimizer\n"
        "m = Olmo3(PRESETS['tiny'].with_vocab(60)); o = build_optimizer(m, OptimSection())\n"
        "t = torch.randint(0, 60, (1, 9)); m(t[:, :-1], labels=t[:, 1:])[0].backward()\n"
        "o.step(); o.zero_grad()\n"
        "print([n for n in ('torch._dynamo', 'torch.distributed.tensor',\n"
        "                   'torch.distributed.fsdp') if n in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _train_step(model: Olmo3, opt: AdamW | torch.optim.Optimizer, seed: int) -> None:
    tokens = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(seed))
    total, _, _ = model(tokens[:, :-1], labels=tokens[:, 1:])
    total.backward()
    opt.step()
    opt.zero_grad()


def test_state_as_checkpoint_tensors_restores_the_same_updates():
    model, twin = tiny_model(), tiny_model()
    opt, twin_opt = build_optimizer(model, CFG), build_optimizer(twin, CFG)
    _train_step(model, opt, 1)
    tensors = optimizer_state_tensors(model, opt)
    assert set(tensors) == {optim_key(n, s) for n, _ in model.named_parameters()
                            for s in ("exp_avg", "exp_avg_sq", "step")}
    twin.load_state_dict(model.state_dict())
    load_optimizer_state(twin, twin_opt, tensors)
    _train_step(model, opt, 2)
    _train_step(twin, twin_opt, 2)
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b), name
