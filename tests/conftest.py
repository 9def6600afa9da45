import os
import sys

# The sharding tests need 8 devices; on CPU, XLA fakes them. It must be set before jax creates its backends, i.e.
# before any test module collected into this process first uses jax.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# The CPU handlers fill their results with NaN before computing them (csrc/ffi/cpu_handlers.cc), so that an element
# the kernels never write fails the tests instead of passing as the allocator's zeros.
os.environ.setdefault("JAX_FLASH_POISON_OUTPUTS", "1")

# The helpers module sits beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from build_refusal_skips import pytest_runtest_makereport  # noqa: E402,F401  (a hook: pytest finds it by name)

# Every suite but test_cuda.py checks the CPU handlers (the specification), so on a machine with a GPU their
# arrays are placed on the CPU; test_cuda.py places its own. JAX_FLASH_TEST_PLATFORM=gpu leaves the default
# device alone (the sharding tests then run on the GPUs).
_OWN_PLACEMENT = {"test_cuda.py"}


@pytest.fixture(autouse=True)
def _cpu_by_default(request):
    if (os.path.basename(str(request.node.fspath)) in _OWN_PLACEMENT
            or os.environ.get("JAX_FLASH_TEST_PLATFORM") == "gpu"):
        yield
        return
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        yield


def pytest_runtest_logreport(report):
    """With JAX_FLASH_FAILURE_LOG set (csrc/cuda/tests/device_run.sh), each failure's traceback is appended to that
    file as it happens: a run cut off by its time limit never prints its failure summary, and without the tracebacks
    a failure says nothing of its size. With JAX_FLASH_DURATION_LOG set, each test's duration is appended to that file
    as it ends. Written by the controlling process only (xdist workers forward reports)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    durations = os.environ.get("JAX_FLASH_DURATION_LOG")  # one line per test as it ends: where a device call's time goes
    if durations and report.when == "call":
        with open(durations, "a", encoding="utf-8") as log:
            log.write(f"{report.duration:8.1f} s  {report.outcome:7}  {report.nodeid}\n")
    path = os.environ.get("JAX_FLASH_FAILURE_LOG")
    if not path or not report.failed:
        return
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
