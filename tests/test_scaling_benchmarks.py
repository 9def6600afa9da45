"""CPU smoke tests of the multi-device scaling scripts (benchmarks/bench_sharding.py,
benchmarks/bench_sharded_training.py) on this process's 8 fake CPU devices (conftest.py): every case runs at every
device count, the sharded results agree with the one-device run, and the scaling arithmetic is what the rows say.
Not timing tests."""

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_sharding  # noqa: E402

# The CPU's fake devices, also on a machine with GPUs (there jax.devices() lists the GPUs).
CPUS = jax.devices("cpu")


def test_every_case_at_every_count_agrees_with_one_device():
    args = bench_sharding.parse_args(["--device-counts", "1", "2", "4", "--seq-len", "128", "--heads", "4",
                                      "--kv-heads", "4", "--head-dim", "16", "--dtype", "float32", "--iters", "1"])
    seen = []
    rows = bench_sharding.run(args, CPUS, on_row=lambda rows: seen.append(len(rows)))
    assert seen == list(range(1, len(rows) + 1))  # results written after every row
    assert [(row["case"], row["devices"]) for row in rows] == [
        (case, n) for case in bench_sharding.CASES for n in (1, 2, 4)]
    for row in rows:
        one, two = (next(r for r in rows if r["case"] == row["case"] and r["devices"] == n) for n in (1, 2))
        n = row["devices"]
        assert row["efficiency_vs_1"] == pytest.approx(one["step_ms"] / (n * row["step_ms"]))
        if n == 1:
            assert row["max_abs_difference_vs_1_device"] is None and row["efficiency_vs_2"] is None
            continue
        assert row["efficiency_vs_2"] == pytest.approx(2 * two["step_ms"] / (n * row["step_ms"]))
        # float32: only the ring's lse merges and summation order differ from the one-device call.
        assert row["max_rel_difference_vs_1_device"] < 1e-5, row
    assert rows[0]["tokens"] == 4 * 128  # the batch case holds lcm(1, 2, 4) sequences


@pytest.mark.parametrize("case, flags, message", [
    ("heads", ["--heads", "6", "--kv-heads", "2", "--seq-len", "64"], "--kv-heads = 2"),
    ("ring-jit", ["--seq-len", "36"], "--seq-len / 2 = 18"),
    ("ring-zigzag", ["--seq-len", "17"], "--seq-len / 2 = 8.5"),
])
def test_counts_that_do_not_divide_the_sharded_axis_are_refused(case, flags, message):
    args = bench_sharding.parse_args(["--device-counts", "1", "4", "--cases", case, "--head-dim", "16", *flags])
    with pytest.raises(SystemExit, match=message):
        bench_sharding.run(args, CPUS)


@pytest.fixture
def training():
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    import bench_sharded_training

    return bench_sharded_training


def test_scaling_rows_arithmetic(training):
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


@pytest.mark.parametrize("all_on_sequence", [True, False])
def test_sharded_training_agrees_with_one_device(training, all_on_sequence):
    args, example = training.parse_args(["--device-counts", "1", "2", "4", "--attention", "ring", "--steps", "2",
                                         "--seq-len", "64", "--batch-size", "2", "--d-model", "32", "--num-heads", "2",
                                         "--num-kv-heads", "2", "--dtype", "float32", "--seq-shards", "2"]
                                        + ["--all-on-sequence"] * all_on_sequence)
    seen = []
    rows = training.run(args, example, CPUS, on_rows=lambda rows: seen.append(len(rows)))
    assert seen == [1, 2, 3]  # results written after every count
    assert [(row["mode"], row["devices"]) for row in rows] == [("ring", 1), ("ring", 2), ("ring", 4)]
    assert all(row["first_loss_agrees"] and len(row["losses"]) == 2 for row in rows), rows
    # --seq-shards 2 is capped at one device and leaves the rest of four on the batch; --all-on-sequence takes all.
    assert training.layout_at(example, 1, all_on_sequence).seq_shards == 1
    assert training.layout_at(example, 4, all_on_sequence).seq_shards == (4 if all_on_sequence else 2)
