"""CPU test of csrc/cuda/tests/attention_kernel_times.py's --summarize: it reads Nsight Compute's CSV (any duration
unit) and keeps the kernels of the last call, the tail that the launches before it repeat twice."""

import pytest
from tool_scripts import NCU_CSV_HEADER, load_tool, ncu_csv_row


def write_csv(path, launches):
    rows = [ncu_csv_row(i, name, unit, value) for i, (name, unit, value) in enumerate(launches)]
    path.write_text("==PROF== Connected to process\n" + "\n".join([NCU_CSV_HEADER] + rows) + "\n")


def test_summarize_keeps_the_last_call(tmp_path, capsys):
    # A first call with autotuning launches, then three calls of [pre, main, main_tail, convert]; the call's own
    # kernel sequence repeats a name (main) so that a tail shorter than the call would not repeat three times.
    call = [("pre", "us", "10.5"), ("main", "ms", "1.25"), ("main", "us", "30"), ("convert", "ns", "2,000")]
    write_csv(tmp_path / "t.csv", [("autotune", "us", "99")] * 3 + call * 3)
    load_tool("attention_kernel_times.py").summarize(str(tmp_path / "t.csv"))
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "4 kernels per call, 1292.5 us in all"
    assert [line.split()[-1] for line in out.splitlines()[1:]] == ["pre", "main", "main", "convert"]
    assert "1250.0 us" in out and "2.0 us" in out


def test_summarize_refuses_a_table_without_repeats(tmp_path):
    write_csv(tmp_path / "t.csv", [("a", "us", "1"), ("b", "us", "2"), ("c", "us", "3")])
    with pytest.raises(SystemExit, match="no repeating tail"):
        load_tool("attention_kernel_times.py").summarize(str(tmp_path / "t.csv"))
