"""benchmarks/compare_runs.py on synthetic results files: the geometric means, the cells-up counts and the pairing
of cells by what they measured (not by position in the file)."""

import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import compare_runs  # noqa: E402


def _row(impl, seqlen, fwd, bwd=None, head_dim=64, causal=False):
    row = {"impl": impl, "head_dim": head_dim, "seqlen": seqlen, "batch": 1, "heads": 1, "causal": causal,
           "feature": "none", "fwd_tflops": fwd}
    if bwd is not None:
        row["bwd_tflops"] = bwd
    return row


def _write(path, rows):
    path.write_text(json.dumps({"gpu": "test", "date": "2026-12-04", "versions": {}, "rows": rows}))
    return str(path)


def test_geometric_means_pair_cells_by_key(tmp_path):
    before = _write(tmp_path / "a.json", [_row("x", 1024, 100, 50), _row("x", 2048, 200, 80), _row("y", 1024, 10)])
    # Reordered, one cell only in `after`, y has no backward: those must not disturb the pairing.
    after = _write(tmp_path / "b.json", [_row("x", 2048, 100, 80), _row("y", 1024, 11), _row("x", 1024, 400, 25),
                                         _row("x", 4096, 999, 999)])
    groups = {(g["impl"], g["direction"]): g for g in compare_runs.geometric_ratios(
        compare_runs.load_rows(before), compare_runs.load_rows(after))}
    assert set(groups) == {("x", "fwd"), ("x", "bwd"), ("y", "fwd")}
    assert math.isclose(groups["x", "fwd"]["geomean"], math.sqrt(4.0 * 0.5))
    assert (groups["x", "fwd"]["up"], groups["x", "fwd"]["cells"]) == (1, 2)
    assert math.isclose(groups["x", "bwd"]["geomean"], math.sqrt(0.5 * 1.0))
    assert groups["x", "bwd"]["up"] == 0
    assert math.isclose(groups["y", "fwd"]["geomean"], 1.1)


def test_command_line_lists_each_step_against_the_one_before(tmp_path):
    files = [_write(tmp_path / f"{name}.json", [_row("jax_flash_sm90", 1024, fwd, 1.0)])
             for name, fwd in (("base", 100), ("one", 110), ("two", 99))]
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(compare_runs.__file__), "compare_runs.py"),
                          *files, "--cells"], check=True, capture_output=True, text=True).stdout
    assert "one.json / base.json" in out and "two.json / one.json" in out
    assert "d=64   fwd  1.100  (1 of 1 cells up)" in out
    assert "d=64   fwd  0.900  (0 of 1 cells up)" in out
    assert " 100/1 " in out and " 110/1 " in out


def test_cells_list_a_failed_row_as_zero(tmp_path):
    """bench_attention.py records a cell an implementation could not run with fwd_tflops None: --cells prints it as
    0, as it does a missing backward, instead of failing on the format."""
    failed = _row("jax_flash_sm90", 1024, None)
    failed["error"] = "ValueError: no"
    files = [_write(tmp_path / "base.json", [_row("jax_flash_sm90", 1024, 100, 1.0)]),
             _write(tmp_path / "broken.json", [failed])]
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(compare_runs.__file__), "compare_runs.py"),
                          *files, "--cells"], check=True, capture_output=True, text=True).stdout
    assert " 100/1 " in out and "   0/0 " in out
