"""How a worker executes its model: settings resolved per device, applied without changing
names or math; the determinism switches touch CUDA only; freed host memory stays in the
process."""

import os
import statistics
import subprocess
import sys

import pytest
import torch

from relaytrain.config.sections import ModelSection
from relaytrain.model import cpu_kernels
from relaytrain.model.backend_choice import choose_matmul
from relaytrain.model.config import PRESETS
from relaytrain.model.init import init_weights
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
    assert prepared.matmul == choose_matmul("auto", cfg, CPU, torch.get_num_threads()).backend
    assert getattr(prepared.layers["0"], "_compiled_call_impl", None) is None  # eager on CPU
    assert prepared.fused == cpu_kernels.resolve("auto", CPU)
    # The GEMM backend and the elementwise kernels round their own way.
    plain.configure(matmul=prepared.matmul, kernels="fused" if prepared.fused else "torch")
    x = torch.randint(0, 500, (2, 40))
    assert torch.equal(prepared(x), plain(x))


@pytest.fixture
def determinism_state(monkeypatch):
    """The process-wide switches set_determinism touches, restored after the test."""
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), inductor_config.deterministic
    torch.use_deterministic_algorithms(False)
    inductor_config.deterministic = False  # a config module: monkeypatch cannot undo on it
    yield lambda: (torch.are_deterministic_algorithms_enabled(),
                   os.environ.get("CUBLAS_WORKSPACE_CONFIG"), inductor_config.deterministic)
    torch.use_deterministic_algorithms(before[0])
    inductor_config.deterministic = before[1]


def test_determinism_switches_leave_the_cpu_alone(determinism_state):
    set_determinism(CPU, exact=True)
    assert determinism_state() == (False, None, False)


def test_exact_on_cuda_turns_every_switch_on_and_fast_turns_them_off(determinism_state):
    # Only the device's type is read, so a CUDA device object tests this on any machine.
    set_determinism(CUDA, exact=True)
    assert determinism_state() == (True, ":4096:8", True)
    set_determinism(CUDA, exact=False)
    # The cuBLAS workspace stays: it must be set before cuBLAS starts, and costs nothing.
    assert determinism_state() == (False, ":4096:8", False)



# Buffers a little larger each time, as a step's grow while glibc's moving threshold follows:
# each allocated, touched and freed. Prints the pages each one faulted in. 24 of them: where the
# heap lies depends on what the process imported (numpy, say), and in some layouts the first
# eight or so retained buffers do not fit the one freed before them; the steady state after
# them is what a training step sees every step (the medians below read it).
FAULT_CYCLES = """
import resource, sys, torch
from relaytrain.train.execution import freed_memory_retained, retain_freed_memory
if sys.argv[1].startswith("retain") and not retain_freed_memory():
    sys.exit(3)
if sys.argv[1].endswith("timed"):  # work timed as a worker runs it, before the cycles
    with freed_memory_retained():
        pass
counts = []
for i in range(24):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.ones(((32 + i) << 18) // 4)  # 8 MiB, then 256 KiB more each time
    del buffer
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*counts)
"""


def faults_per_buffer(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", FAULT_CYCLES, mode], capture_output=True,
                         text=True, timeout=120)
    if out.returncode == 3:
        pytest.skip("the C library is not glibc")
    assert out.returncode == 0, out.stderr
    return [int(n) for n in out.stdout.split()]


@pytest.mark.timeout(240)
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    pages = 8 * 2**20 // 4096  # about what each buffer touches
    retained, default = faults_per_buffer("retain"), faults_per_buffer("default")
    assert retained[0] >= pages // 2  # the first does fault its memory in (seen: 1 or 2 more)
    # then only the 256 KiB each one grew by (one may fault more: a thread of torch's starting)
    assert statistics.median(retained[3:]) <= pages // 8, retained
    # Control: under glibc's defaults every one is mapped and faulted in afresh.
    assert min(default[3:]) >= pages // 2


@pytest.mark.timeout(240)
def test_work_timed_as_a_worker_runs_it_leaves_the_process_its_own_memory_setting():
    """`freed_memory_retained` (the `auto` measurements): a process that kept freed memory
    before still does after; one that did not gets glibc's defaults back."""
    pages = 8 * 2**20 // 4096
    assert statistics.median(faults_per_buffer("retain, timed")[3:]) <= pages // 8
    assert min(faults_per_buffer("timed")[3:]) >= pages // 2
