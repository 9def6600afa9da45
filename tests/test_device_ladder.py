"""csrc/cuda/tests/device_ladder.sh on the CPU: its steps see the patches applied cumulatively, in order, a patch that
does not apply stops the ladder, and the tree is restored at the end (device_run.sh's `cmd` stage needs no GPU)."""

import os
import shutil
import subprocess
import tarfile

import pytest

_TESTS = os.path.join(os.path.dirname(__file__), "..", "csrc", "cuda", "tests")


def _patch(old: str, new: str) -> str:
    return f"--- a/value.txt\n+++ b/value.txt\n@@ -1 +1 @@\n-{old}\n+{new}\n"


def _ladder(tmp_path, patches: dict[str, str]):
    """Runs the ladder in a scratch tree holding value.txt = "zero"; returns (summary, {step: what cmd printed})."""
    if shutil.which("patch") is None:
        pytest.skip("needs patch(1)")
    repo = tmp_path / "repo"
    scripts = repo / "csrc" / "cuda" / "tests"
    scripts.mkdir(parents=True)
    for name in ("device_run.sh", "device_ladder.sh"):
        shutil.copy(os.path.join(_TESTS, name), scripts / name)
    (repo / "value.txt").write_text("zero\n")
    for name, text in patches.items():
        (repo / f"{name}.patch").write_text(text)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), LADDER_PATCHES=" ".join(f"{name}.patch" for name in patches),
               LADDER_STAGES="cmd", CMD_CMD="cat value.txt", TOTAL_LIMIT="120")
    subprocess.run(["bash", "csrc/cuda/tests/device_ladder.sh"], cwd=repo, env=env, check=True,
                   capture_output=True, text=True, timeout=120)
    assert (repo / "value.txt").read_text() == "zero\n", "the patches were not reverted"
    assert sorted(os.listdir(out)) == ["results.tar.gz", "summary.log"]
    printed = {}
    with tarfile.open(out / "results.tar.gz") as outer:
        for member in outer.getmembers():
            if member.name.endswith("results.tar.gz"):
                step = member.name.split("/")[-2]
                with tarfile.open(fileobj=outer.extractfile(member)) as inner:
                    printed[step] = inner.extractfile("./cmd.log").read().decode().strip()
    return (out / "summary.log").read_text(), printed


def test_steps_see_the_patches_applied_in_order(tmp_path):
    summary, printed = _ladder(tmp_path, {"one": _patch("zero", "one"), "two": _patch("one", "two")})
    assert printed == {"base": "zero", "one": "one", "two": "two"}
    assert [line.split(":")[0] for line in summary.splitlines()] == ["base", "one", "two"]


def test_a_patch_that_does_not_apply_stops_the_ladder(tmp_path):
    summary, printed = _ladder(tmp_path, {"one": _patch("zero", "one"), "bad": _patch("zero", "two"),
                                          "never": _patch("two", "three")})
    assert printed == {"base": "zero", "one": "one"}
    assert "bad: does not apply" in summary
