"""How a worker executes its model: settings resolved per device, applied without changing
names or math; the determinism switches touch CUDA only."""

import torch

from relaytrain.config import ModelSection
from relaytrain.model.config import PRESETS
from relaytrain.model.init import init_weights
from relaytrain.model.matmul import resolve_matmul
from relaytrain.model.olmo3 import Olmo3
from relaytrain.train.execution import compiles, prepare_model, set_determinism

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_compile_auto_means_blocks_on_cuda_only():
    assert compiles("auto", CUDA) and not compiles("auto", CPU)
    assert compiles("blocks", CPU) and not compiles("none", CUDA)


def test_prepare_model_configures_without_renaming_or_changing_the_output():
    cfg = PRESETS["tiny"].with_vocab(500)
    plain, prepared = Olmo3(cfg), Olmo3(cfg)
    init_weights(plain, 0)
    init_weights(prepared, 0)
    prepared = prepare_model(prepared, ModelSection(checkpointing="full"), CPU)
    assert [n for n, _ in prepared.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(b.checkpoint for b in prepared.layers.values())
    assert prepared.attention == "auto"
    assert prepared.matmul == resolve_matmul("auto", CPU)
    assert getattr(prepared.layers["0"], "_compiled_call_impl", None) is None  # eager on CPU
    plain.configure(matmul=prepared.matmul)  # the GEMM backend rounds its own way
    x = torch.randint(0, 500, (2, 40))
    assert torch.equal(prepared(x), plain(x))


def test_determinism_switches_leave_the_cpu_alone():
    before = torch.are_deterministic_algorithms_enabled()
    set_determinism(CPU, exact=True)
    assert torch.are_deterministic_algorithms_enabled() == before

