"""device_run.sh's kernel_times stage on the CPU, with a stand-in for Nsight Compute: each timing process runs under
its own limit, a process that hangs (as ncu did at attach in the fifty-sixth session) fails its case only, the other
cases are still timed, the stage exits 1, and a timing process left behind by the hung one is killed."""

import os
import shutil
import sys

import pytest
from tool_scripts import NCU_CSV_HEADER, ncu_csv_row, run_device_run_function

# Stand-in ncu: the command line ends with `python3 TOOL --impl I --head-dim D --seqlen S ...`. At 2048 keys it
# starts a process that names the tool (a target left behind), records its pid and hangs; otherwise it prints a CSV
# of four calls of one kernel lasting seqlen / 8 us.
_FAKE_NCU = r"""#!/usr/bin/env bash
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  case ${args[i]} in --seqlen) seqlen=${args[i + 1]} ;; python3) tool=${args[i + 1]} ;; esac
done
echo "==PROF== Connected to process $$"
if [ "$seqlen" = 2048 ]; then
  bash -c 'sleep 120; true' "$tool" &
  echo $! >> "$LEFT_BEHIND"
  exec sleep 120
fi
echo 'HEADER'
for i in 0 1 2 3; do echo "ROW"; done
"""


def _fake_ncu():
    row = ncu_csv_row("$i", "forward_kernel", "us", "$((seqlen / 8))").replace('"', '\\"')
    return _FAKE_NCU.replace("HEADER", NCU_CSV_HEADER).replace("ROW", row)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.split()[:2] == ["State:", "Z"] for line in status)
    except FileNotFoundError:
        return True


def test_a_hung_timing_process_fails_its_case_only(tmp_path):
    if shutil.which("bash") is None or shutil.which("timeout") is None or shutil.which("pkill") is None:
        pytest.skip("needs bash, timeout and pkill")
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc")
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    (bin_dir / "ncu").write_text(_fake_ncu())
    (bin_dir / "python3").write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "$@"\n')
    for tool in ("ncu", "python3"):
        os.chmod(bin_dir / tool, 0o755)
    left_behind = tmp_path / "left_behind"
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", LEFT_BEHIND=str(left_behind),
               KERNEL_TIMES_CASES="64:1024:causal 64:2048:causal 128:4096", KERNEL_TIMES_PROCESS_LIMIT="2")
    result = run_device_run_function(tmp_path, "kernel_times", f"repo={repo}; out={out}", check=False, env=env)

    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines.count("1 kernels per call, 128.0 us in all") == 2  # 1024 keys, both implementations
    assert lines.count("1 kernels per call, 512.0 us in all") == 2  # 4096 keys, after the hung case
    failures = [line for line in lines if line.startswith("failed (exit 124)")]
    assert len(failures) == 2, result.stdout
    pids = [int(pid) for pid in left_behind.read_text().split()]
    assert len(pids) == 2 and all(_gone(pid) for pid in pids), "the left-behind timing processes must be killed"
