"""`moed iobench`: the report's shape, its byte identity, the saved file, scratch mode,
errors, and the page-residency helper."""
from __future__ import annotations

import json
import mmap

import numpy as np
import pytest

from daemon.commands.cli import main
from daemon.store.probe import (QUEUE_DEPTHS, ProbeInterrupted, model_target, resident_pages,
                                run_iobench, scratch_target)
from daemon.store.reads import drop_page_cache, probe_direct_io
from ext.makemodel import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("iobench") / "m", arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=128, intermediate=64, dtype="bf16", seed=0)


def _check_report(report: dict, direct_ok: bool) -> None:
    assert set(report) >= {"device", "io_path", "block_bytes", "results"}
    assert isinstance(report["device"], str) and report["device"]
    assert report["io_path"] == ("direct" if direct_ok else "buffered")
    block = report["block_bytes"]
    assert isinstance(block, int) and block > 0 and block % 4096 == 0
    cells = [(r["mode"], r["queue_depth"]) for r in report["results"]]
    modes = ("direct", "buffered") if direct_ok else ("buffered",)
    assert cells == [(m, qd) for m in modes for qd in QUEUE_DEPTHS]
    for r in report["results"]:
        assert isinstance(r["gb_per_s"], float) and r["gb_per_s"] > 0
        assert set(r["latency_ms"]) == {"p50", "p99"}
        assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
        assert isinstance(r["repeats"], int) and r["repeats"] >= 2
        assert len(r["gb_per_s_runs"]) == r["repeats"]
        assert r["spread"]["gb_per_s_min"] <= r["gb_per_s"] <= r["spread"]["gb_per_s_max"]
        assert r["reads"] >= r["repeats"] * r["queue_depth"]  # every slot read at least once
        assert r["bytes"] == r["reads"] * block
        if r["mode"] == "buffered":
            assert len(r["page_residency"]) == r["repeats"]
            for res in r["page_residency"]:
                assert 0.0 <= res["before"] <= 1.0 and 0.0 <= res["after"] <= 1.0
        else:
            assert "page_residency" not in r


def test_cli_json_on_stdout_equals_saved_state_file(model_dir, tmp_path, capsys):
    state = tmp_path / "state"
    assert main(["iobench", "--model", str(model_dir), "--seconds", "2",
                 "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    report = json.loads(out)
    target = model_target(model_dir)
    _check_report(report, probe_direct_io(target.files[0]))
    assert report["block_bytes"] == target.block_bytes
    saved = state / f"iobench-{report['device']}.json"
    assert json.loads(saved.read_text()) == report
    assert [p.name for p in state.iterdir()] == [saved.name]  # no temp file left behind


def test_model_blocks_are_the_commonest_expert_slot(model_dir):
    import collections

    from daemon.store.plans import plans_for
    from ext.formats.checkpoint import Checkpoint
    from ext.models.config import load_config
    from ext.models.experts import ExpertLayout

    target = model_target(model_dir)
    ck = Checkpoint(model_dir)
    sizes = collections.Counter(p.slot_bytes for p in plans_for(ExpertLayout(ck, load_config(model_dir))).values())
    ck.close()
    assert target.block_bytes == sizes.most_common(1)[0][0]
    assert target.plans and all(p.slot_bytes == target.block_bytes for p in target.plans)


@pytest.mark.parametrize("direct", [False, None])
def test_direct_call_counts_bytes_as_reads_times_block(model_dir, direct):
    target = model_target(model_dir)
    report = run_iobench(target, seconds=0.2, repeats=2, direct=direct)
    direct_ok = probe_direct_io(target.files[0]) if direct is None else direct
    _check_report(report, direct_ok)


def test_an_interrupted_run_stops_between_passes(model_dir):
    target = model_target(model_dir)
    asked = []

    def interrupted() -> bool:
        asked.append(1)
        return len(asked) > 3          # three passes, then stop

    with pytest.raises(ProbeInterrupted, match="after 3 of"):
        run_iobench(target, seconds=0.2, repeats=2, direct=False, interrupted=interrupted)
    assert len(asked) == 4


def test_scratch_file_is_written_read_and_removed(tmp_path, capsys):
    scratch = tmp_path / "scratch.bin"
    state = tmp_path / "state"
    assert main(["iobench", "--file", str(scratch), "--size", "1M", "--block", "64K",
                 "--seconds", "2", "--state-dir", str(state)]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert f"saved to {state / ('iobench-' + report['device'] + '.json')}" in err
    assert report["block_bytes"] == 64 << 10
    assert report["blocks"] == 16
    assert not scratch.exists()
    _check_report(report, report["io_path"] == "direct")
    assert json.loads((state / f"iobench-{report['device']}.json").read_text()) == report


def test_existing_scratch_file_is_kept(tmp_path):
    scratch = tmp_path / "keep.bin"
    scratch.write_bytes(b"x" * (256 << 10))
    target, created = scratch_target(scratch, None, 64 << 10)
    assert not created and len(target.plans) == 4
    assert [p.spans[0].offset for p in target.plans] == [0, 64 << 10, 128 << 10, 192 << 10]


def test_a_model_that_does_not_exist_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["iobench", "--model", str(tmp_path / "nope"), "--seconds", "1",
              "--state-dir", str(tmp_path / "s")])
    assert e.value.code == 2
    assert f"moed iobench: error: --model: {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("argv, message", [
    (["--model", "{empty}"], "model.safetensors"),
])
def test_bad_model_exits_1_with_a_message(tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    argv = [a.format(missing=tmp_path / "nope", empty=tmp_path / "empty") for a in argv]
    assert main(["iobench", *argv, "--seconds", "1", "--state-dir", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moed iobench: error:") and message in err
    assert not (tmp_path / "s").exists()


def test_model_and_file_together_is_a_usage_error(model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["iobench", "--model", str(model_dir), "--file", str(tmp_path / "f")])
    assert e.value.code == 2


def test_residency_is_full_after_reading_and_not_higher_after_dropping(tmp_path):
    path = tmp_path / "pages.bin"
    path.write_bytes(np.random.default_rng(0).bytes(64 * mmap.PAGESIZE))
    with open(path, "rb") as f:
        f.read()
    resident, pages = resident_pages(path)
    assert pages == 64 and resident == 64
    drop_page_cache([path])
    after, _ = resident_pages(path)
    assert after <= resident


def test_residency_of_an_empty_file(tmp_path):
    path = tmp_path / "empty.bin"
    path.touch()
    assert resident_pages(path) == (0, 0)


def test_experts_split_across_shards_do_not_set_the_block(tmp_path):
    """Sharded small, a few experts' slots are larger (their projections sit in two files);
    the block is the size most experts have, so a real checkpoint is not refused."""
    d = make_model(tmp_path / "m", arch="qwen3_moe", layers=2, experts=8, top_k=2, hidden=128,
                   intermediate=64, dtype="bf16", seed=0, shard_size=100_000)
    target = model_target(d)
    assert target.block_bytes == 53248 and len(target.plans) >= 6     # of 12 with that size


def test_model_blocks_follow_a_lowbit_models_expert_bytes(tmp_path):
    """The probe reads blocks the size of the model's own (smaller) expert slots."""
    bf16 = make_model(tmp_path / "b", arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=256,
                      intermediate=128, seed=1)
    mx = make_model(tmp_path / "m", arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=256,
                    intermediate=128, seed=1, dtype="mxfp4")
    # bf16: 3 x 256 x 128 x 2 = 192 KiB; mxfp4: 3 x 128 x 256 / 2 + scales = 49.5 KiB
    assert model_target(bf16).block_bytes >= 192 * 1024
    assert model_target(mx).block_bytes <= 56 * 1024
