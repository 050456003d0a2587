"""The stage executor: what each schedule's backward computes when updates happen between a
micro-batch's F and B (in-process, a middle stage with scripted neighbours), then real
multi-process pipelines of the production Worker over gloo (a pool of processes started once):
flush schedules equal the unpipelined model, every schedule reruns bit for bit, measured
staleness stays within its bound, weight versions are as scheduled, DP x PP and CP x PP in
exact mode."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from relaytrain.data.loader import Batch
from relaytrain.model.config import PRESETS
from relaytrain.model.olmo3 import MLP
from relaytrain.model.stages import build_stage
from relaytrain.parallel.pipeline.schedules import (
    build_schedule,
    staleness,
    weight_versions,
)
from relaytrain.parallel.reduce import GradReducer
from relaytrain.train.pipeline_stage import StageRunner, StageSpec, global_order, model_order
from tests.runtime.conftest import tiny_config
from tests.train.pool import WorkerPool

torch.set_num_threads(1)
S, STAGE, M, MB, T = 3, 1, 4, 2, 3  # a middle stage of three, 4 micro-batches of [2, 3]
LR = 0.05


class ScriptedNeighbours:
    """The transport of a middle stage: receives return fixed tensors, sends are kept."""

    def __init__(self, inputs: dict[tuple[int, int], torch.Tensor]):
        self.inputs = inputs
        self.sent: dict[tuple[int, int], torch.Tensor] = {}
        self.waited = 0.0

    def send(self, tensor, dst, tag):
        self.sent[(dst, tag)] = tensor.detach().clone()

    def expect(self, receives, shape):  # scripted inputs are always there: nothing to post
        pass

    def recv(self, shape, src, tag):
        return self.inputs[(src, tag)].clone()

    def drain(self):
        pass


class RecordingSGD(torch.optim.SGD):
    """SGD (an in-place update) that keeps the weights and gradient of every step."""

    def __init__(self, params):
        super().__init__(params, lr=LR)
        self.log: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        self.log.append(([p.detach().clone() for p in params],
                         [p.grad.detach().clone() for p in params]))
        return super().step(closure)


def run_middle_stage(schedule: str, mode: str = "perf", n_stages: int = S, a: int = 1,
                     m_count: int = M, stage: int = STAGE, predict: bool = False,
                     split: bool = False):
    """One span of one global batch of `m_count` micro-batches through `stage` of `n_stages`,
    a U after every `a` B's (a=1: update k applies exactly micro-batch k-1's gradient). The
    stage is the model's SwiGLU MLP."""
    cfg = PRESETS["tiny"].with_vocab(64)
    torch.manual_seed(0)
    mlp = MLP(cfg)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(MB, T, cfg.d_model, generator=g) for _ in range(m_count)]
    gs = [torch.randn(MB, T, cfg.d_model, generator=g) for _ in range(m_count)]
    inputs = ({(stage - 1, 2 * m): xs[m] for m in range(m_count)}
              | {(stage + 1, 2 * m + 1): gs[m] for m in range(m_count)})
    net = ScriptedNeighbours(inputs)
    opt = RecordingSGD(mlp.parameters())
    spec = StageSpec(schedule=schedule, stage=stage, n_stages=n_stages, micro_per_batch=m_count,
                     dp=1, micro_batch=MB, seq_len=T, d_model=cfg.d_model, z_loss=0.0,
                     clip=0.0, a=a, recompute=mode == "mem", predict=predict, split=split)
    reducer = GradReducer(list(mlp.parameters()), None, exact=False,
                          total_micro_batches=m_count)
    runner = StageRunner(mlp, opt, reducer, spec, net, stage - 1, stage + 1, None, lambda step: LR,
                         torch.device("cpu"))
    batch = Batch(0, np.arange(m_count * MB), np.zeros(m_count * MB, dtype=np.int64),
                  [(m, torch.zeros(MB, T + 1, dtype=torch.long)) for m in range(m_count)])
    out = runner.run_span(1, [batch])
    names = [n for n, _ in mlp.named_parameters()]
    return cfg, names, xs, gs, net, opt, out[0].pipeline


def weights(names, tensors):
    return dict(zip(names, tensors, strict=True))


def mlp_closed_form(x, g, w_f, w_b):
    """Backward of the SwiGLU MLP with activations computed at weights `w_f` and weights read
    by the backward from `w_b`: the gradients (weights, input)."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    a = x2 @ w_f["gate_proj.weight"].T
    b = x2 @ w_f["up_proj.weight"].T
    s = F.silu(a)
    h = s * b
    dh = g2 @ w_b["down_proj.weight"]
    ds, db = dh * b, dh * s
    sig = torch.sigmoid(a)
    da = ds * sig * (1 + a * (1 - sig))
    grads = {"down_proj.weight": g2.T @ h, "gate_proj.weight": da.T @ x2,
             "up_proj.weight": db.T @ x2}
    dx = da @ w_b["gate_proj.weight"] + db @ w_b["up_proj.weight"]
    return grads, dx.reshape(x.shape)


def exact_gradient(cfg, w, x, g):
    mlp = MLP(cfg)
    mlp.load_state_dict(w)
    xg = x.clone().requires_grad_()
    mlp(xg).backward(g)
    return {n: p.grad for n, p in mlp.named_parameters()}, xg.grad


def near(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    """Equal up to float rounding: max difference within `tol` of the largest magnitude."""
    return float((a - b).abs().max()) <= tol * float(b.abs().max())


def close(a: dict, b: dict, tol: float = 1e-5) -> bool:
    return all(near(a[k], b[k], tol) for k in a)


def test_naive_inplace_update_between_forward_and_backward_trips_autograd():
    """The problem the executor solves: without the aliases, stock autograd refuses."""
    cfg = PRESETS["tiny"].with_vocab(64)
    mlp = MLP(cfg)
    y = mlp(torch.randn(MB, T, cfg.d_model)).sum()
    with torch.no_grad():
        for p in mlp.parameters():
            p.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_paci_perf_mode_uses_forward_time_activations_and_backward_time_weights():
    cfg, names, xs, gs, net, opt, stats = run_middle_stage("paci")
    acts = build_schedule("paci", S, M, 1)
    assert stats.staleness == [staleness(acts)[(STAGE, m)] for m in range(M)] == [0, 1, 1, 1]
    assert stats.weight_versions == 1
    for m in range(1, M):  # F(m) ran after update m-1, B(m) after update m
        w_f, w_b = weights(names, opt.log[m - 1][0]), weights(names, opt.log[m][0])
        assert not close(w_f, w_b)
        grad = weights(names, opt.log[m][1])
        want, want_dx = mlp_closed_form(xs[m], gs[m], w_f, w_b)
        assert close(grad, want)
        assert near(net.sent[(0, 2 * m + 1)], want_dx)
        # the last layer's gradient needs no weight: it is the exact one at F's weights; the
        # others are neither the exact gradient at F's weights nor at B's, but the mix above
        at_f = exact_gradient(cfg, w_f, xs[m], gs[m])[0]
        at_b = exact_gradient(cfg, w_b, xs[m], gs[m])[0]
        assert near(grad["down_proj.weight"], at_f["down_proj.weight"])
        for k in ("gate_proj.weight", "up_proj.weight"):
            assert not near(grad[k], at_f[k], 1e-3) and not near(grad[k], at_b[k], 1e-3)


def test_zb_h1_splits_the_backward_into_the_same_bits_as_1f1bs_whole_one(monkeypatch):
    """B sends the input gradient before any weight gradient exists; W adds them later: the
    gradients sent upstream and the update's gradient equal 1f1b's bit for bit. (Alone, the
    stage's norm is the pipeline's: the flush schedules' all-gather has no peers here.) Stage 2
    of 4 defers two W's, the last two of the batch's after its last B."""
    monkeypatch.setattr(StageRunner, "_global_norm",
                        lambda self, grads, order, ok: (torch.nn.utils.get_total_norm(grads), ok))
    *_, net, opt, stats = run_middle_stage("1f1b", n_stages=4, stage=2)
    *_, zb_net, zb_opt, zb_stats = run_middle_stage("zb-h1", n_stages=4, stage=2)
    assert net.sent.keys() == zb_net.sent.keys()
    assert all(torch.equal(net.sent[k], zb_net.sent[k]) for k in net.sent)
    [(w, g)], [(zb_w, zb_g)] = opt.log, zb_opt.log
    assert all(torch.equal(a, b) for a, b in zip(w + g, zb_w + zb_g, strict=True))
    assert zb_stats.weight_s > 0 and stats.weight_s == 0
    # stage 2 of 4 holds 2 micro-batches awaiting B under both, and under zb-h1 up to 2 more
    # awaiting W: each only its linear layers' inputs and output gradients, less than one
    # awaiting B (its whole graph), which the runtime reports
    assert stats.peak_memory < zb_stats.peak_memory < 2 * stats.peak_memory


def test_interleaved_norms_are_summed_in_model_order_which_changes_their_bits():
    """interleaved-1f1b's ranks hold layers out of model order (pp 2 x V 2: rank 0 holds layers
    0 and 2, rank 1 layers 1 and 3); the global norm puts the per-tensor norms gathered in rank
    order back into model order (`model_order`), so it is the unpipelined `get_total_norm` to
    the bit. Summed in rank order instead, the norm differs in its last bits for some
    gradients: the reordering is needed."""
    cfg = PRESETS["small"].with_vocab(64)
    whole = [n for n, _ in build_stage(cfg, 0, 1, [range(4)]).named_parameters()]
    ranks = [build_stage(cfg, r, 2, [range(i, i + 1) for i in range(4)]) for r in range(2)]
    params = [(n, p) for rank in ranks for n, p in rank.named_parameters()]
    assert [n for n, _ in params] != whole  # rank order is not model order
    order = model_order([global_order(n) for n, _ in params])
    assert [params[i][0] for i in order] == whole
    differ = 0
    for seed in range(20):  # gradients of every tensor's shape and a scale of its own
        gen = torch.Generator().manual_seed(seed)
        grads = {n: torch.randn(p.shape, generator=gen) * float(torch.rand(1, generator=gen))
                 for n, p in params}
        want = torch.nn.utils.get_total_norm([grads[n] for n in whole])
        norms = torch.stack(torch._foreach_norm([grads[n] for n, _ in params], 2.0))
        assert torch.equal(torch.linalg.vector_norm(norms[order], 2.0), want)
        differ += not torch.equal(torch.linalg.vector_norm(norms, 2.0), want)
    assert differ > 0


def updates_before(acts) -> dict[str, dict[int, int]]:
    """Per micro-batch, the stage's updates before its F and before its B."""
    out: dict[str, dict[int, int]] = {"F": {}, "B": {}}
    updates = 0
    for act in acts:
        if act.kind == "U":
            updates += 1
        else:
            out[act.kind][act.mb] = updates
    return out


def test_paci_prediction_forwards_stale_micro_batches_on_weights_an_update_ahead():
    """With `predict`, F(m) of a micro-batch that crosses one update runs on theta + delta
    (delta: the update before it), formed op by op; the graph keeps the live weights, so B reads
    theta_B as without prediction. The span's first update has nothing before it, so F(1) runs
    on the live weights, as without."""
    cfg, names, xs, gs, net, opt, stats = run_middle_stage("paci", predict=True)
    assert stats.staleness == [0, 1, 1, 1]
    w = [weights(names, opt.log[k][0]) for k in range(M)]  # w[k]: after update k
    want, want_dx = mlp_closed_form(xs[1], gs[1], w[0], w[1])  # nothing to predict from
    assert close(weights(names, opt.log[1][1]), want)
    for m in (2, 3):  # F(m) after update m-1, B(m) after update m
        ahead = {k: 2 * w[m - 1][k] - w[m - 2][k] for k in names}
        want, want_dx = mlp_closed_form(xs[m], gs[m], ahead, w[m])
        assert close(weights(names, opt.log[m][1]), want)
        assert near(net.sent[(0, 2 * m + 1)], want_dx)
        assert not close(ahead, w[m], 1e-3)  # a prediction, not the weights B reads


def test_paci_prediction_holds_no_weight_copy():
    """The prediction is a transient of the op that reads it: one weight version, and the peak
    is the run without prediction's plus at most one weight (a saved prediction would add the
    MLP's three weights per micro-batch in flight)."""
    *_, stats = run_middle_stage("paci", predict=True)
    *_, off = run_middle_stage("paci")
    largest = max(p.numel() * p.element_size() for p in MLP(PRESETS["tiny"]).parameters())
    assert stats.weight_versions == off.weight_versions == 1
    assert off.peak_memory < stats.peak_memory <= off.peak_memory + largest


def test_paci_prediction_with_split_lists_trains_the_whole_backwards_bits():
    """Under `split` each linear layer's product takes its prediction detached (its weight
    gradient comes at W): the graph saves the live weight for it all the same, so B's input
    gradient and W's weight gradients are the whole backward's bits."""
    *_, net, opt, stats = run_middle_stage("paci", predict=True)
    *_, net_split, opt_split, split_stats = run_middle_stage("paci", predict=True, split=True)
    assert split_stats.weight_s > 0 and split_stats.weight_versions == 1
    assert all(torch.equal(a, b) for (w, g), (w2, g2) in zip(opt.log, opt_split.log, strict=True)
               for a, b in zip(w + g, w2 + g2, strict=True))
    assert all(torch.equal(x, net_split.sent[k]) for k, x in net.sent.items())


def test_paci_prediction_refuses_compiled_blocks():
    """Compiled code never forms the prediction (model.compile auto compiles on CUDA)."""
    cfg = PRESETS["tiny"].with_vocab(64)
    mlp = MLP(cfg)
    mlp.compiled = True
    spec = StageSpec(schedule="paci", stage=STAGE, n_stages=S, micro_per_batch=M, dp=1,
                     micro_batch=MB, seq_len=T, d_model=cfg.d_model, z_loss=0.0, clip=0.0,
                     predict=True)
    with pytest.raises(ValueError, match="^config key 'parallel.paci.predict': compiled"):
        StageRunner(mlp, None, None, spec, None, STAGE - 1, STAGE + 1, None, lambda step: LR,
                    torch.device("cpu"))


@pytest.mark.parametrize(("n_stages", "a"), [(5, 1), (5, 2)])
def test_paci_stale_weight_gradients_of_a_deep_pipeline_at_its_bound(n_stages, a):
    """Stage 1 of 5 holds up to 4 micro-batches, so one crosses up to ceil((S-i-1)/a) updates
    (PACI's bound, computed here from the paper's formula): 3 at a=1, 2 at a=2. Each update
    applies the sum of its group's gradients, each with forward-time activations and
    backward-time weights, however many updates apart those are."""
    m_count = 8
    cfg, names, xs, gs, net, opt, stats = run_middle_stage("paci", n_stages=n_stages, a=a,
                                                          m_count=m_count)
    at = updates_before(build_schedule("paci", n_stages, m_count, 1, a=a)[STAGE])
    stale = [at["B"][m] - at["F"][m] for m in range(m_count)]
    bound = math.ceil((n_stages - STAGE - 1) / a)
    assert stats.staleness == stale and max(stale) == bound == stats.staleness_bound
    assert len(opt.log) == m_count // a
    for u, (_, grad) in enumerate(opt.log):
        want = {n: torch.zeros_like(t) for n, t in zip(names, grad, strict=True)}
        for m in [m for m in range(m_count) if at["B"][m] == u]:
            w_f, w_b = weights(names, opt.log[at["F"][m]][0]), weights(names, opt.log[u][0])
            if at["F"][m] < u:
                assert not close(w_f, w_b)  # a stale micro-batch: the weights moved under it
            g, dx = mlp_closed_form(xs[m], gs[m], w_f, w_b)
            want = {n: want[n] + g[n] for n in want}
            assert near(net.sent[(0, 2 * m + 1)], dx)
        assert close(weights(names, grad), want)


def test_paci_mem_mode_is_the_exact_gradient_at_the_live_weights():
    cfg, names, xs, gs, net, opt, stats = run_middle_stage("paci", "mem")
    assert stats.staleness == [0, 1, 1, 1]
    for m in range(M):
        w_b = weights(names, opt.log[m][0])
        want, want_dx = exact_gradient(cfg, w_b, xs[m], gs[m])
        assert close(weights(names, opt.log[m][1]), want, 1e-6)
        assert near(net.sent[(0, 2 * m + 1)], want_dx, 1e-6)


def test_pipedream_stashes_the_forward_weights_for_the_backward():
    cfg, names, xs, gs, net, opt, stats = run_middle_stage("pipedream")
    acts = build_schedule("pipedream", S, M, 1)
    assert stats.weight_versions == weight_versions(acts)[STAGE] == 2
    for m in range(1, M):
        w_f = weights(names, opt.log[m - 1][0])
        want, want_dx = exact_gradient(cfg, w_f, xs[m], gs[m])
        assert close(weights(names, opt.log[m][1]), want, 1e-6)
        assert near(net.sent[(0, 2 * m + 1)], want_dx, 1e-6)
    # the forward sent downstream used the live weights at F too
    y = MLP(cfg)
    y.load_state_dict(weights(names, opt.log[1][0]))
    with torch.no_grad():
        assert near(net.sent[(2, 4)], y(xs[2]), 1e-6)


# ---- real multi-process pipelines ----------------------------------------------------------

STEPS = 4  # M = 4 micro-batches per step (global batch 8, micro-batch 2)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(4) as p:
        yield p


@pytest.fixture(scope="module")
def runs(pool, corpus_data, tmp_path_factory):
    """Results of each configuration, computed once for the tests below."""
    cache: dict[tuple[str, ...], list[dict]] = {}
    base = tmp_path_factory.mktemp("pool")

    def run(*overrides: str, spans: tuple[int, ...] = (STEPS,), again: bool = False,
            data: str = corpus_data, heldout: tuple[int, ...] = ()):
        key = (data, *overrides, str(spans), str(again), str(heldout))
        if key not in cache:
            cfg = tiny_config(base / str(len(cache)), data, f"train.max_steps={STEPS}",
                              "runtime.engine=ray", *overrides)
            cache[key] = pool.train(cfg, spans, heldout)
        return cache[key]

    return run


def final_weights(results: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r["weights"])
    return out


def assert_every_rank_has_the_bits_of(res: list[dict], ref: list[dict]) -> None:
    """The run's losses, every rank's global norms and every rank's final weights (a stage's,
    gathered whole) are the reference run's bits."""
    assert step_losses(res) == step_losses(ref)
    norms = [s["grad_norm"] for s in ref[0]["steps"]]
    assert all([s["grad_norm"] for s in r["steps"]] == norms for r in res)
    ref_w = final_weights(ref)
    for r in res:
        assert all(torch.equal(w, ref_w[k]) for k, w in r["weights"].items()), r["rank"]


def step_losses(results: list[dict]) -> list[float]:
    """The step loss as the controller combines it: mean over micro-batches in index order."""
    per_step = []
    for i in range(STEPS):
        losses = {}
        for r in results:
            losses.update(r["steps"][i]["losses"])
        per_step.append(math.fsum(losses[j][0] for j in range(len(losses))) / len(losses))
    return per_step


def last_stage(results: list[dict]) -> dict:
    return max(results, key=lambda r: (r["stage"], -r["dp_rank"]))


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest per-tensor relative difference, |a - b| / |b| in the 2-norm."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in a)


@pytest.mark.timeout(120)
def test_flush_schedules_give_the_unpipelined_gradients_and_curve(runs, capsys):
    ref = runs()
    ref_w, ref_loss = final_weights(ref), step_losses(ref)
    ref_norms = [s["grad_norm"] for s in ref[0]["steps"]]
    got = {}
    for name in ("gpipe", "1f1b", "zb-h1"):
        res = runs("parallel.pp=2", f"parallel.schedule={name}")
        got[name] = final_weights(res)
        norms = [s["grad_norm"] for s in last_stage(res)["steps"]]
        diffs = {"weights": max_rel(got[name], ref_w),
                 "loss": max(abs(a / b - 1) for a, b in zip(step_losses(res), ref_loss,
                                                            strict=True)),
                 "grad_norm": max(abs(a / b - 1) for a, b in zip(norms, ref_norms, strict=True))}
        with capsys.disabled():
            print(f"\n{name} pp=2 vs unpipelined, max relative difference: {diffs}")
        assert max(diffs.values()) <= 1e-6
    assert all(torch.equal(got["gpipe"][k], got["1f1b"][k]) for k in ref_w)
    assert all(torch.equal(got["zb-h1"][k], got["1f1b"][k]) for k in ref_w)


@pytest.mark.timeout(120)
def test_paci_flushing_every_batch_with_a_batch_per_update_is_1f1b(runs):
    f1b = runs("parallel.pp=2", "parallel.schedule=1f1b")
    paci = runs("parallel.pp=2", "parallel.schedule=paci", "parallel.paci.flush=true",
                "parallel.paci.a=4", spans=(2, 2))
    assert step_losses(paci) == step_losses(f1b)
    w, ref = final_weights(paci), final_weights(f1b)
    assert all(torch.equal(w[k], ref[k]) for k in ref)


ASYNC = [("pipedream", "perf", 2, 1), ("paci", "perf", 2, 1), ("paci", "mem", 2, 1),
         ("paci", "perf", 4, 1), ("paci", "perf", 4, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "mode", "pp", "a"), ASYNC)
def test_async_schedules_rerun_bit_identically_within_their_staleness_bound(runs, name, mode,
                                                                            pp, a):
    opts = ("model.n_layers=4",) if pp == 4 else ()
    args = (*opts, f"parallel.pp={pp}", f"parallel.schedule={name}",
            f"parallel.paci.mode={mode}", f"parallel.paci.a={a}")
    first, again = runs(*args, spans=(2, 2)), runs(*args, spans=(2, 2), again=True)
    assert step_losses(first) == step_losses(again)
    w, w2 = final_weights(first), final_weights(again)
    assert all(torch.equal(w[k], w2[k]) for k in w)
    acts = build_schedule(name, pp, M, 2, a=a)
    for r in first:
        # PACI's bound from the paper's formula: at stage i of S, ceil((S - i - 1) / a).
        bound = math.ceil((pp - r["stage"] - 1) / a)
        seen = [x for s in r["steps"] for x in s["pipeline"]["staleness"]]
        assert max(seen) == bound == r["steps"][0]["pipeline"]["staleness_bound"]  # reached
        assert seen == [staleness(acts)[(r["stage"], m)] for m in range(2 * M)] * 2
        expected = weight_versions(acts)[r["stage"]] if name == "pipedream" else 1
        assert r["steps"][0]["pipeline"]["weight_versions"] == expected


@pytest.mark.timeout(120)
def test_paci_split_trains_paci_bits_and_prediction_reruns_bit_identically(runs):
    """`paci.split` sends each input gradient before forming the weight gradient: the bits of
    the whole backward. `paci.predict` forwards stale micro-batches on predicted weights:
    other bits, the same on a rerun (a pure function of the list and of each span's start)."""
    args = ("parallel.pp=2", "parallel.schedule=paci", "parallel.paci.mode=perf",
            "parallel.paci.a=1")  # ASYNC's run: cached
    whole = runs(*args, spans=(2, 2))
    for other, rerun in ((runs(*args, "parallel.paci.split=true", spans=(2, 2)), whole),
                         (runs(*args, "parallel.paci.predict=true", spans=(2, 2)),
                          runs(*args, "parallel.paci.predict=true", spans=(2, 2), again=True))):
        assert step_losses(other) == step_losses(rerun)
        w, w2 = final_weights(other), final_weights(rerun)
        assert all(torch.equal(w[k], w2[k]) for k in w)
    predicted = final_weights(runs(*args, "parallel.paci.predict=true", spans=(2, 2)))
    assert not all(torch.equal(predicted[k], x) for k, x in final_weights(whole).items())


@pytest.mark.timeout(120)
def test_every_flush_schedule_reruns_bit_identically(runs):
    for name in ("gpipe", "1f1b", "zb-h1"):
        a = runs("parallel.pp=2", f"parallel.schedule={name}")
        b = runs("parallel.pp=2", f"parallel.schedule={name}", again=True)
        assert step_losses(a) == step_losses(b)
        assert all(torch.equal(x, final_weights(b)[k]) for k, x in final_weights(a).items())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("layout", "model"), [
    (("parallel.pp=2", "parallel.dp=2"), ()),
    (("parallel.pp=2", "parallel.dp=2", "parallel.schedule=zb-h1"), ()),
    # every stage defers its W's differently (stage i by i backwards)
    (("parallel.pp=4", "parallel.schedule=zb-h1"), ("model.n_layers=4",)),
    # two chunks per rank (virtual stages 0, 2 on rank 0 and 1, 3 on rank 1), with DP
    (("parallel.pp=2", "parallel.dp=2", "parallel.schedule=interleaved-1f1b",
      "parallel.virtual_stages=2"), ("model.n_layers=4",)),
    # and sharded: each chunk's blocks and the root (embedding on rank 0, head on rank 1)
    # FSDP units over the stage's two workers, reduce-scattered as integers
    (("parallel.pp=2", "parallel.fsdp=2", "parallel.schedule=interleaved-1f1b",
      "parallel.virtual_stages=2"), ("model.n_layers=4",))])
def test_dp_by_pp_in_exact_mode_is_bit_identical_to_the_unpipelined_model(runs, layout, model):
    ref = runs("determinism=exact", *model)
    res = runs("determinism=exact", *model, *layout)
    assert step_losses(res) == step_losses(ref)
    # the global norm too (clipping scales by it), gathered from stages in any layer order
    assert [s["grad_norm"] for s in last_stage(res)["steps"]] == [
        s["grad_norm"] for s in ref[0]["steps"]]
    w, ref_w = final_weights([r for r in res if r["dp_rank"] == 0]), final_weights(ref)
    assert all(torch.equal(w[k], ref_w[k]) for k in ref_w)
    if "parallel.dp=2" in layout or "parallel.fsdp=2" in layout:
        replica = final_weights([r for r in res if r["dp_rank"] == 1])
        assert all(torch.equal(w[k], replica[k]) for k in ref_w)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("layout", "model"), [
    (("parallel.schedule=1f1b",), ()),
    # each stage's state sharded over its cp ranks (FSDP2's hooks, the integer reduce-scatter)
    (("parallel.schedule=1f1b", "parallel.shard_over_cp=true"), ()),
    # deferred weight gradients around the cp attention's own backward
    (("parallel.schedule=zb-h1",), ()),
    # two chunks per rank: the wrap link joins the last stage's cp rank to the first's (on
    # demand: 7 s here, a reference of its own)
    pytest.param(("parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2"),
                 ("model.n_layers=4",), marks=pytest.mark.soak)])
def test_pp_by_cp_in_exact_mode_is_bit_identical_to_the_unpipelined_cp_run(runs, layout, model):
    """pp 2 x cp 2: each stage's two cp ranks hold their halves of every micro-batch and send
    them to the next stage's rank of the same cp rank; its cp group runs the attention exchange
    and the last stage's loss is the cp-weighted mean: the losses, global norms and every
    rank's final weights are pp 1 x cp 2's bits."""
    ref = runs("determinism=exact", "parallel.cp=2", *model)
    res = runs("determinism=exact", "parallel.cp=2", *model, "parallel.pp=2", *layout)
    assert sorted((r["stage"], r["cp_rank"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_every_rank_has_the_bits_of(res, ref)


@pytest.mark.soak  # eight worker processes: on demand
@pytest.mark.timeout(300)
def test_fsdp_by_cp_by_pp_in_exact_mode_is_bit_identical_to_the_unpipelined_cp_run(
        runs, corpus_data, tmp_path):
    """fsdp 2 x cp 2 x pp 2, the whole world = dp x fsdp x cp x pp: each stage's state sharded
    over its fsdp x cp ranks, the same bits as pp 1 x cp 2 on one DP rank."""
    ref = runs("determinism=exact", "parallel.cp=2")
    cfg = tiny_config(tmp_path, corpus_data, f"train.max_steps={STEPS}", "runtime.engine=ray",
                      "determinism=exact", "parallel.cp=2", "parallel.pp=2", "parallel.fsdp=2",
                      "parallel.schedule=1f1b")
    with WorkerPool(8) as eight:
        res = eight.train(cfg, (STEPS,), ())
    assert sorted((r["stage"], r["dp_rank"], r["cp_rank"]) for r in res) == [
        (s, d, c) for s in range(2) for d in range(2) for c in range(2)]
    assert_every_rank_has_the_bits_of(res, ref)  # each gathers its stage's whole weights


# packed instances of documents of 1 to ~100 tokens (seq_len 32, window 16), document-masked;
# data.seed 3 puts the mix's two padded instances (76 and 183) in steps 3 and 2
PACKED = ("data.instances=packed", "data.source_group_size=2",
          "data.source_permutation_seed=123", "data.order=olmo-core", "data.seed=3")
HELDOUT = tuple(range(8))  # of the mix's held-out split


def heldout_losses(results: list[dict]) -> dict[int, float]:
    """Instance -> held-out loss, from the ranks that computed one (equal where several did)."""
    out: dict[int, float] = {}
    for r in results:
        for i, loss in r["heldout"].items():
            assert out.setdefault(i, loss) == loss
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("cp", "layout"), [
    (1, ("parallel.schedule=1f1b",)),
    # deferred weight gradients; a forward recomputed at B (flushing, one update a batch)
    (1, ("parallel.schedule=zb-h1",)),
    (1, ("parallel.schedule=paci", "parallel.paci.mode=mem", "parallel.paci.flush=true",
         "parallel.paci.a=4")),
    (2, ("parallel.schedule=1f1b",))])
def test_packed_masked_instances_in_pipeline_stages_train_the_unpipelined_bits(
        runs, packed_mix, cp, layout):
    """pp 2 (x cp 2) on packed, document-masked instances: every stage reads each
    micro-batch's document lengths from its own batch, so every stage's attention and RoPE
    positions stay within documents (each cp rank's part carrying its rows' document ids) and
    the last stage ignores the padding's labels: the losses, global norms and every rank's
    final weights are pp 1's (x cp 2) bits, and so are the held-out losses after them (the
    indexed held-out split's instances are seq_len tokens, its inputs one fewer)."""
    ref = runs("determinism=exact", f"parallel.cp={cp}", *PACKED, data=packed_mix,
               heldout=HELDOUT)
    res = runs("determinism=exact", f"parallel.cp={cp}", *PACKED, "parallel.pp=2", *layout,
               data=packed_mix, heldout=HELDOUT)
    assert heldout_losses(res) == heldout_losses(ref) and len(heldout_losses(ref)) == 8
    assert_every_rank_has_the_bits_of(res, ref)


@pytest.mark.timeout(120)
def test_indexed_instances_of_seq_len_tokens_train_in_pipeline_stages(runs, packed_mix):
    """Concatenated instances cut from OLMo-core token arrays are seq_len tokens (their inputs
    one fewer, as packed ones'), not the prepared data's seq_len + 1: the messages between
    stages take the inputs' length, so pp 2 trains and evaluates pp 1's bits on them too."""
    args = ("determinism=exact", "data.order=olmo-core")
    ref = runs(*args, data=packed_mix, heldout=HELDOUT)
    res = runs(*args, "parallel.pp=2", data=packed_mix, heldout=HELDOUT)
    assert step_losses(res) == step_losses(ref)
    assert heldout_losses(res) == heldout_losses(ref)
    ref_w = final_weights(ref)
    for r in res:
        assert all(torch.equal(w, ref_w[k]) for k, w in r["weights"].items()), r["rank"]
