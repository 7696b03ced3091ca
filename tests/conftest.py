"""Tests run on CPU with 8 simulated devices, compiled for speed of compiling; the longest test
files start first."""

import atexit
import contextlib
import gc
import os
import re
import shutil
import sys
import tempfile

import pytest

from hotjax import simulate_cpu_devices

simulate_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests compile far more than they run: machine code unoptimised by LLVM compiles about a
# third faster, and XLA:CPU's older elemental emitters instead of its MLIR fusion emitters
# about 40 % faster again, and in one piece rather than split for parallel code generation
# (whose splitting costs more than it saves on programs this small) about 15 % faster again.
# XLA's own passes (partitioning, fusion, buffer assignment) still run
# and float semantics do not change: results are the same, memory analyses within a few hundred
# bytes of temporaries. The subprocesses the tests start inherit them.
for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
             "--xla_cpu_parallel_codegen_split_count=1"):
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

# JAX's CUDA plugin (installed for compiling to GPU targets, which the tests do in this process)
# logs on a machine without a driver, as JAX loads it and as the backend starts, that it found
# none: absl's lines from before its log is set up, which no log level hides.
_CUDA_DRIVER_LINE = re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers|"
                               r"^WARNING: All log messages before absl::InitializeLog\(\)")


@contextlib.contextmanager
def _without_cuda_driver_lines():
    """Whatever the block writes to stderr (file descriptor 2), less the CUDA plugin's lines
    that there is no driver."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(x for x in lines if not _CUDA_DRIVER_LINE.search(x)))


# One persistent compilation cache for the whole run: both workers and every process the tests
# start read it, so a program compiled once (the same step under another Trainer, a child's
# training run) is not compiled again.
if "HOTJAX_COMPILATION_CACHE" not in os.environ:
    os.environ["HOTJAX_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="hotjax-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["HOTJAX_COMPILATION_CACHE"], ignore_errors=True)

with _without_cuda_driver_lines():
    import jax

    from hotjax.compile_cache import enable_compilation_cache

    enable_compilation_cache()  # starts the backend


# The test files that take longest, longest first. pytest-xdist gives each worker whole files
# (`--dist loadfile`) in this order (`--no-loadscope-reorder`), so that a long file never starts
# last while the other worker idles; the rest follow in name order and fill in at the end.
LONGEST_FIRST = ("test_benchmarks_planner.py", "test_multiprocess.py", "test_benchmarks.py",
                 "test_cli.py", "test_gpu_compile.py", "test_checkpoint_resume.py", "test_cost.py",
                 "test_pipeline.py", "test_checkpoint_dcp.py", "test_checkpoint.py",
                 "test_checkpoint_deepspeed.py", "test_parallelism.py", "test_examples.py",
                 "test_plan.py", "test_hot.py", "test_targets.py",
                 "test_checkpoint_megatron_core.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a file too


@pytest.fixture(scope="session")
def devices() -> list[jax.Device]:
    found = jax.devices()
    assert len(found) == 8, "tests expect 8 simulated CPU devices (JAX_NUM_CPU_DEVICES=8)"
    return found


def _memory_maps() -> tuple[int, int]:
    """This process's memory maps, and the kernel's limit on them (Linux; else zeros)."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After a test module, drop the compiled programs once they hold half the kernel's limit on
    a process's memory maps: XLA:CPU maps memory for every executable, a whole session's pass
    the limit (`vm.max_map_count`, 65530 by default), and there XLA crashes while compiling.
    Below it they stay cached, so later modules reuse them."""
    yield
    used, limit = _memory_maps()
    if used > limit // 2:
        from hotjax import step

        step.bucket_step.cache_clear()
        step.home.cache_clear()
        jax.clear_caches()
        gc.collect()
