"""CPU smoke tests of the multi-device scaling scripts (benchmarks/bench_sharding.py,
benchmarks/bench_sharded_training.py) on this process's 8 fake CPU devices (conftest.py): every case runs at every
device count, the sharded results agree with the one-device run, and the scaling arithmetic is what the rows say.
Not timing tests."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_sharding  # noqa: E402

training = pytest.importorskip("bench_sharded_training", exc_type=ImportError)  # needs flax and optax


def test_every_case_at_every_count_agrees_with_one_device():
    args = bench_sharding.parse_args(["--device-counts", "1", "2", "4", "--seq-len", "128", "--heads", "4",
                                      "--kv-heads", "4", "--head-dim", "16", "--dtype", "float32", "--iters", "1"])
    rows = bench_sharding.run(args)
    assert [(row["case"], row["devices"]) for row in rows] == [
        (case, n) for case in bench_sharding.CASES for n in (1, 2, 4)]
    for row in rows:
        if row["devices"] == 1:
            assert row["max_abs_difference_vs_1_device"] is None and row["speedup_vs_1"] == 1.0
            continue
        # float32: only the ring's lse merges and summation order differ from the one-device call.
        assert row["max_rel_difference_vs_1_device"] < 1e-5, row
        assert row["efficiency_vs_1"] == pytest.approx(row["speedup_vs_1"] / row["devices"])
    assert rows[0]["tokens"] == 4 * 128  # the batch case holds as many sequences as the largest count


def test_counts_that_do_not_divide_the_sharded_axis_are_refused():
    args = bench_sharding.parse_args(["--device-counts", "1", "4", "--cases", "heads", "--heads", "6",
                                      "--kv-heads", "2", "--seq-len", "64", "--head-dim", "16"])
    with pytest.raises(SystemExit, match="--kv-heads = 2"):
        bench_sharding.run(args)


def test_scaling_rows_arithmetic():
    runs = {("ring", 1): ([2.0, 1.5, 1.2], [9.0, 0.8, 0.8]),
            ("ring", 2): ([2.0, 1.5, 1.3], [5.0, 0.5, 0.5]),
            ("ring", 4): ([2.1, 1.6, 1.2], [4.0, 0.25, 0.25])}
    rows = training.scaling_rows(runs, batch_tokens=1000, tolerance=1e-2)
    by_count = {row["devices"]: row for row in rows}
    assert by_count[2]["speedup_vs_1"] == pytest.approx(1.6)
    assert by_count[2]["efficiency_vs_1"] == pytest.approx(0.8)
    assert by_count[4]["efficiency_vs_2"] == pytest.approx(2 * 0.5 / (4 * 0.25))
    assert by_count[1]["efficiency_vs_2"] is None
    assert by_count[4]["tokens_per_s"] == pytest.approx(4000)
    assert by_count[2]["first_loss_agrees"] and not by_count[4]["first_loss_agrees"]  # 2.1 vs 2.0: 5% off
    assert by_count[2]["max_loss_abs_difference_vs_1"] == pytest.approx(0.1)


def test_sharded_training_on_a_ring_agrees_with_one_device(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_sharded_training.py", "--device-counts", "1", "2", "--all-on-sequence",
                                      "--attention", "ring", "--steps", "2", "--seq-len", "64", "--batch-size", "2",
                                      "--d-model", "32", "--num-heads", "2", "--num-kv-heads", "2",
                                      "--dtype", "float32", "--out-dir", str(tmp_path)])
    training.main()  # exits 1 where a first-step loss disagrees
    (path,) = tmp_path.iterdir()
    rows = json.loads(path.read_text())["rows"]
    assert [(row["mode"], row["devices"]) for row in rows] == [("ring", 1), ("ring", 2)]
    assert all(row["first_loss_agrees"] and len(row["losses"]) == 2 for row in rows)
