"""Running as a CPU without AVX-512, AMX or bf16 instructions runs, on any x86-64 machine with AVX2.

``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` hold torch's vectorised kernels and oneDNN's (which computes
CPU autocast's bf16 products) to AVX2: ``make test-avx2`` and CI run the fast tests and the slow ``cpu_features``
ones that way. These tests show the knob does what that run relies on, in fresh processes (both libraries read
the variables once, when they load), and that the user-facing bf16 refusal then happens for real.
"""

import platform
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT
from tests.training_runs import subprocess_env

AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def cpu_has_avx2() -> bool:
    try:
        return " avx2 " in f" {open('/proc/cpuinfo').read().replace(chr(10), ' ')} "
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not cpu_has_avx2(),
    reason="holding the kernels to AVX2 needs an x86-64 CPU with AVX2 (this one is "
    f"{platform.machine()}, AVX2 {'present' if cpu_has_avx2() else 'absent'})",
)


def run_held(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**subprocess_env(), **AVX2_ONLY}, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_knob_hides_avx512_amx_and_bf16_from_torch_and_onednn():
    """With the variables set, torch dispatches its AVX2 kernels, oneDNN reports no bf16 (what ``cpu_has_bf16``
    and the refusal of --mixed_precision bf16 read), and every benchmark's machine line says so."""
    code = (
        "import torch; from training.hardware import cpu_has_bf16; from benchmarks.common import machine_line\n"
        "print(torch.backends.cpu.get_cpu_capability(), cpu_has_bf16()); print(machine_line(1))"
    )
    result = run_held(code)
    assert result.returncode == 0, result.stderr[-3000:]
    capability, line = result.stdout.strip().splitlines()
    assert capability == "AVX2 False"
    assert "kernels AVX2, bf16 in software, held by ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" in line


def test_bf16_mixed_precision_is_refused_on_a_cpu_without_bf16_for_real():
    """The refusal tests/test_preflight.py shows with the hardware's answer replaced, here with nothing replaced: the
    pre-flight check stops --mixed_precision bf16 with its message; ``allow_emulated_bf16`` (for the tests and
    benchmarks that check dtypes and bytes, not speed) lets it pass, and the Accelerator runs in bf16."""
    code = (
        "from training.args import TrainConfig; from training.loop import make_accelerator\n"
        "from training.preflight import preflight\n"
        "cfg = TrainConfig(mixed_precision='bf16', dataset_name='x', output_dir='/nonexistent/run')\n"
        "preflight(cfg, cpu=True, allow_emulated_bf16=True)\n"
        "print(make_accelerator(cfg, cpu=True).mixed_precision)\n"
        "preflight(cfg, cpu=True)"
    )
    result = run_held(code)
    assert result.returncode == 1 and result.stdout.strip() == "bf16", result.stderr[-3000:]
    assert "UsageError: --mixed_precision bf16 on a CPU without bfloat16 instructions" in result.stderr
