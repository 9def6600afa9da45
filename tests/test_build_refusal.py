"""The CUDA dispatcher's "this build has no kernel" refusals (csrc/cuda/build_refusal.h), which the standalone GPU
check skips on builds narrowed by the development switches (JAX_FLASH_CHECK_SKIP_UNBUILT) and fails otherwise."""

import os
import re

from cpu_checks import run_cpu_check

_DISPATCH = os.path.join(os.path.dirname(__file__), "..", "csrc", "cuda", "dispatch.cu")


def test_build_refusals_are_recognised(tmp_path):
    run_cpu_check("build_refusal_check.cc", tmp_path)


def test_dispatch_writes_every_build_refusal_through_the_helper():
    """A "this build has ..." message spelled as a plain literal would not be recognised as a build refusal."""
    with open(_DISPATCH) as f:
        source = f.read()
    assert re.findall(r'"this build has', source) == []
    assert source.count("build_refusal(") >= 5
