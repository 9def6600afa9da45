"""csrc/cuda/tests/device_run.sh's restore_source_times on the CPU: a source file sent again with the same content
gets back the time it had at the last build (so ninja keeps its objects), a changed one keeps its fresh time."""

import os
import shutil
import subprocess

import pytest

_DEVICE_RUN = os.path.join(os.path.dirname(__file__), "..", "csrc", "cuda", "tests", "device_run.sh")


def _restore(repo):
    script = f"source <(sed -n '/^restore_source_times() {{/,/^}}/p' {_DEVICE_RUN}) && restore_source_times"
    subprocess.run(["bash", "-c", script], cwd=repo, check=True, capture_output=True, text=True, timeout=60)


def _resend(paths, ns):
    """What the device tool does to every file of the tree: a fresh time (here an explicit, later one)."""
    for path in paths:
        os.utime(path, ns=(ns, ns))


def test_unchanged_sources_get_their_build_time_back(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    repo = tmp_path / "repo"
    (repo / "csrc" / "sub").mkdir(parents=True)
    kept, changed, top = repo / "csrc" / "sub" / "kept.h", repo / "csrc" / "changed.cu", repo / "CMakeLists.txt"
    for path in (kept, changed, top):
        path.write_text(f"// {path.name}\n")
    first = 1_700_000_000_000_000_000
    _resend((kept, changed, top), first)
    _restore(repo)  # the first build: nothing recorded yet, times stay
    assert kept.stat().st_mtime_ns == first

    second = first + 3_600_000_000_000
    _resend((kept, changed, top), second)
    changed.write_text("// changed.cu, edited\n")
    os.utime(changed, ns=(second, second))
    _restore(repo)
    assert kept.stat().st_mtime_ns == first
    assert top.stat().st_mtime_ns == first
    assert changed.stat().st_mtime_ns == second, "a changed file must keep its fresh time (ninja rebuilds it)"

    third = second + 3_600_000_000_000
    _resend((kept, changed, top), third)
    _restore(repo)  # the edit is now the recorded content, with the time it had at the second build
    assert changed.stat().st_mtime_ns == second
    assert kept.stat().st_mtime_ns == first
