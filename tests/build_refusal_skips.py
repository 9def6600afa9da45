"""A pytest plugin: on a build narrowed by the development switches (JAX_FLASH_CUDA_FP16=OFF, JAX_FLASH_CUDA_HEAD_DIMS,
...), a GPU test whose kernel the build left out is reported as skipped, not failed, as the standalone check does
(csrc/cuda/tests/standalone_check.cu). Only with JAX_FLASH_CHECK_SKIP_UNBUILT=1, which csrc/cuda/tests/device_run.sh
exports for exactly those builds; on a full build such a refusal stays a failure. tests/conftest.py loads it."""
import os

import pytest

# The CUDA handler's errors begin so (csrc/ffi/cuda_handlers.cc), inside XLA's "INTERNAL: ..." error, and the
# dispatcher's refusals go on so (kBuildRefusalPrefix, csrc/cuda/build_refusal.h).
HANDLER_PREFIX = "jax_flash (CUDA): "
REFUSAL_PREFIX = "this build has "


def build_refusal(error: BaseException) -> str | None:
    """The refusal's own words ("this build has ...") where `error` is one, else None: a RuntimeError (XLA's
    JaxRuntimeError is one) whose message says so, never a failed assertion that happens to quote those words."""
    if not isinstance(error, RuntimeError):
        return None
    message = str(error)
    start = message.find(HANDLER_PREFIX + REFUSAL_PREFIX)
    if start < 0:
        return None
    return message[start + len(HANDLER_PREFIX):].split(" [executable_name=")[0].splitlines()[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (os.environ.get("JAX_FLASH_CHECK_SKIP_UNBUILT") != "1" or report.when != "call" or not report.failed
            or call.excinfo is None):
        return
    refusal = build_refusal(call.excinfo.value)
    if refusal is not None:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: unbuilt kernel: {refusal}")
