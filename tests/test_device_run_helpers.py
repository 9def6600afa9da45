"""Helpers of csrc/cuda/tests/device_run.sh, on the CPU: restore_source_times (a source file sent again with the same
content gets back the time it had at the last build, so ninja keeps its objects; a changed one keeps its fresh time)
and matching_prebuilt (the carried kernel library whose stamp is the tree's)."""

import os
import shutil

import pytest
from tool_scripts import run_device_run_function


def _restore(repo):
    run_device_run_function(repo, "restore_source_times csrc CMakeLists.txt")


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


def test_the_prebuilt_library_of_these_sources_is_chosen(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    for folder, stamp in (("prebuilt", "base"), ("prebuilt_ab", "patched"), ("prebuilt_old", "older")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "stamp").write_text(stamp + "\n")

    def chosen(stamp):
        run = run_device_run_function(tmp_path, "matching_prebuilt", f"kernel_stamp() {{ echo {stamp}; }}",
                                      check=False)
        return run.stdout.strip() if run.returncode == 0 else None

    assert chosen("base") == "prebuilt"
    assert chosen("patched") == "prebuilt_ab"
    assert chosen("other") is None
