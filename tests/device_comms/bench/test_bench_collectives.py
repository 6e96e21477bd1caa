"""The collectives benchmark runs end to end (no timing is asserted: numbers are noisy)."""

from __future__ import annotations

import argparse
import json

import pytest

from device_comms.bench import collectives as bench
from device_comms.bench.report import format_markdown, human_bytes
from shm_broadcast import cli_args


def test_parse_size() -> None:
    assert bench._parse_size("1K") == 1024
    assert bench._parse_size("64KiB") == 64 << 10
    assert bench._parse_size("16M") == 16 << 20
    assert bench._parse_size("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="64K"):
        bench._parse_size("lots")
    assert human_bytes(1 << 20) == "1 MiB" and human_bytes(1000) == "1000 B"


def test_parse_threads() -> None:
    assert cli_args.threads("default") == "default"
    assert cli_args.threads(" 1 ") == 1 and cli_args.threads("6") == 6
    assert cli_args.threads("1024") == 1024
    assert bench.threads_for("default", 2) is None
    assert bench.threads_for(3, 2) == 3
    assert bench.threads_for(None, 2) >= 1


@pytest.mark.parametrize("bad", ["0", "-1", "all", "1.5", "²", "1025", "99999999999999999999"])
def test_parse_threads_refuses(bad: str) -> None:
    """Not an int from 1 to 1024 (a count torch would refuse killed every rank)."""
    with pytest.raises(argparse.ArgumentTypeError, match="'default' or an int from 1 to 1024"):
        cli_args.threads(bad)


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--world-sizes", "1"]) == 2
    assert "world size" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_small_run_writes_json_and_plot(tmp_path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = bench.main([
        "--world-sizes", "2", "--dtypes", "bfloat16", "--sizes", "4K",
        "--min-iters", "2", "--max-iters", "3", "--json", str(out), "--plot", str(png),
        "--threads", "1", "3",
    ])
    assert rc == 0
    data = json.loads(out.read_text())
    recs = data["results"]
    assert data["meta"]["threads"] == ["1", "3"]
    assert sorted((r["op"], r["dtype"], r["bytes"], r["threads_setting"]) for r in recs) == sorted(
        (op, dt, b, t) for op in ("all_reduce", "all_gather", "reduce_scatter")
        for dt in ("bfloat16",) for b in (4096,) for t in ("1", "3")
    )
    for r in recs:
        assert r["results_match"] and r["mode"] == "shm" and r["world_size"] == 2
        assert r["shm_p50_us"] > 0 and r["gloo_p50_us"] > 0
        assert r["threads"] == int(r["threads_setting"]) and r["engine_threads"] >= 1
    assert png.stat().st_size > 1000
    md = format_markdown(recs)
    assert "| 4 KiB |" in md
    assert "torch threads per rank: 1 (--threads 1)" in md and "(--threads 3)" in md


def test_routing_splits_are_uneven_skewed_and_sum_to_the_rows() -> None:
    for ws in (2, 3, 4, 8):
        splits = [bench.routing_splits(1000, ws, r) for r in range(ws)]
        assert all(sum(s) == 1000 and min(s) >= 0 for s in splits)
        assert splits == [bench.routing_splits(1000, ws, r) for r in range(ws)]  # deterministic
        recv = [sum(s[j] for s in splits) for j in range(ws)]
        assert max(recv) >= 1.3 * min(recv)  # one receiver is hot
        if ws > 2:
            assert all(splits[r][(r + 1) % ws] == 0 for r in range(ws))


@pytest.mark.slow  # the CLI itself runs in test_small_run_writes_json_and_plot
@pytest.mark.timeout(120)
def test_all_to_allv_run(tmp_path) -> None:

    out = tmp_path / "a2av.json"
    rc = bench.main([
        "--world-sizes", "3", "--ops", "all_to_allv", "--dtypes", "bfloat16", "float32",
        "--sizes", "4K", "96K", "--min-iters", "2", "--max-iters", "3", "--threads", "1",
        "--json", str(out),
    ])
    assert rc == 0
    recs = json.loads(out.read_text())["results"]
    assert {(r["op"], r["dtype"], r["bytes"]) for r in recs} == {
        ("all_to_allv", dt, b) for dt in ("bfloat16", "float32") for b in (4096, 96 << 10)}
    for r in recs:
        assert r["results_match"] and r["mode"] == "shm" and r["threads"] == 1
        assert 1 / 3 < r["hot_share"] < 1 and r["row_bytes"] <= 4096
        assert r["shm_p50_us"] > 0 and r["gloo_p50_us"] > 0


def test_cuda_bench_plans_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """What ``--device cuda`` decides before touching a GPU: sizes are whole elements,
    sizes the custom all-reduce cannot take go to NCCL only, and no GPU exits 2."""
    import torch

    from device_comms.bench import cuda

    assert cuda._whole_elements(1000, torch.float32) == 1000
    assert cuda._whole_elements(1001, torch.float32) == 1000
    assert cuda._whole_elements(1, torch.bfloat16) == 2
    args = argparse.Namespace(world_sizes=[2], calls=1, reps=1)
    for nbytes in (1000, 16 << 20):  # not a multiple of 16; over the 8 MiB limit
        assert cuda._virtual_row(nbytes, torch.float32, args, []) == {
            "bytes": nbytes, "dtype": "float32"}
        assert "NCCL only" in capsys.readouterr().out
    if not torch.cuda.is_available():
        args = argparse.Namespace(device="cuda", dtypes=["float32", "bfloat16"],
                                  world_sizes=[2, 4], sizes=None, json_path=None)
        assert bench.run_bench(args) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("argv,sizes", [
    (["--decode"], bench.DECODE_SIZES),
    (["--decode", "--min-bytes", "4K", "--max-bytes", "512K"],
     [4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10]),
    (["--sizes", "3K"], [3 << 10]),
], ids=["decode", "decode-bounded", "sizes"])
def test_decode_preset_picks_decode_step_sizes(argv: list[str], sizes: list[int]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_bench_args(parser)
    args = parser.parse_args(argv)
    bench.fill_defaults(args, dtypes=["float32"], world_sizes=[2])
    assert bench._rank_config(args)["sizes"] == sizes


@pytest.mark.parametrize("argv,dtypes,world_sizes", [
    ([], ["float32", "bfloat16"], [2, 4]),
    (["--dtypes", "bfloat16"], ["bfloat16"], [2, 4]),
    (["--device", "cuda", "--dtypes", "float32", "bfloat16", "--world-sizes", "2", "4"],
     ["float32", "bfloat16"], [2, 4]),
], ids=["cpu-defaults", "cpu-explicit", "cuda-explicit-equal-to-cpu-defaults"])
def test_explicit_dtypes_and_world_sizes_are_kept(argv: list[str], dtypes: list[str],
                                                  world_sizes: list[int]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_bench_args(parser)
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    bench.fill_defaults(args, dtypes=["float32", "bfloat16"] if cpu else ["bfloat16"],
                        world_sizes=[2, 4] if cpu else [2, 4, 8])
    assert (args.dtypes, args.world_sizes) == (dtypes, world_sizes)


def test_decode_and_sizes_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_bench_args(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--decode", "--sizes", "1K"])
    assert e.value.code == 2
    assert "--decode" in capsys.readouterr().err
