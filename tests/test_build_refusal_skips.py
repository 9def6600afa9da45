"""tests/build_refusal_skips.py: a build refusal is a skip only on a narrowed build, and nothing else is."""
import os
import subprocess
import sys
import textwrap

import pytest

TESTS_DIR = os.path.dirname(__file__)

CASES = textwrap.dedent('''
    def test_refused():
        raise RuntimeError("INTERNAL: jax_flash (CUDA): this build has no float16 kernels "
                           "(built with JAX_FLASH_CUDA_FP16=OFF) [executable_name='jit_f']")

    def test_wrong_result():
        assert 1 == 2, "jax_flash (CUDA): this build has nothing to do with it"

    def test_other_error():
        raise RuntimeError("INTERNAL: jax_flash (CUDA): an illegal memory access")
''')


def run_cases(tmp_path, narrowed: bool) -> str:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {k: v for k, v in os.environ.items() if k != "JAX_FLASH_CHECK_SKIP_UNBUILT"}
    if narrowed:
        env["JAX_FLASH_CHECK_SKIP_UNBUILT"] = "1"
    env["PYTHONPATH"] = TESTS_DIR + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "build_refusal_skips", "-p", "no:cacheprovider",
                             "-rfs", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_cases.py")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    return result.stdout


@pytest.mark.parametrize("narrowed", [True, False])
def test_build_refusals_skip_only_on_narrowed_builds(tmp_path, narrowed):
    out = run_cases(tmp_path, narrowed)
    if narrowed:
        assert "2 failed, 1 skipped" in out, out
        assert "unbuilt kernel: this build has no float16 kernels (built with JAX_FLASH_CUDA_FP16=OFF)" in out, out
    else:
        assert "3 failed" in out, out
    assert "FAILED test_cases.py::test_wrong_result" in out and "FAILED test_cases.py::test_other_error" in out, out


def test_build_refusal_words():
    from build_refusal_skips import build_refusal

    assert build_refusal(RuntimeError("INTERNAL: jax_flash (CUDA): this build has no d=96 kernels "
                                      "[executable_name='x']\nmore")) == "this build has no d=96 kernels"
    assert build_refusal(ValueError("q: expected 4 dimensions")) is None
    assert build_refusal(AssertionError("jax_flash (CUDA): this build has no d=96 kernels")) is None
