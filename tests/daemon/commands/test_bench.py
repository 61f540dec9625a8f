"""`moed bench`: the report's keys, its identities, and the naive mode's definition."""
from __future__ import annotations

import json

import pytest

from daemon.commands.bench_runs import BenchConfig, flops_per_token, run_bench
from daemon.commands.cli import main
from ext.makemodel import make_model
from ext.models.config import load_config

KEYS = {"tokens_per_second", "hit_rate", "bytes_read_per_token", "prefetch_recall",
        "prefetch_wasted_bytes", "io_wait_share", "roofline_tokens_per_second", "io_path"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("bench") / "m", arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32, shard_size=40_000,
                      initializer_range=0.2)


def test_report_has_every_figure_for_both_modes(model_dir):
    report = run_bench(BenchConfig(model=str(model_dir), cache_bytes=6 * 3 * 8192, tokens=8,
                                   repeats=1, threads=1, io_workers=2))
    assert KEYS <= set(report) and KEYS <= set(report["naive"])
    naive = report["naive"]
    # naive: no prefetch at all; moed's figures are fractions where they should be
    assert naive["prefetch_recall"] == 0.0 and naive["prefetch_wasted_bytes"] == 0.0
    for mode in (report, naive):
        assert 0.0 <= mode["hit_rate"] <= 1.0
        assert mode["bytes_read_per_token"] >= 0
        assert mode["roofline_tokens_per_second"] > 0
    assert report["speedup_vs_naive"] == pytest.approx(
        report["tokens_per_second"] / naive["tokens_per_second"])
    # naive has only dynamic slots; moed stages 3/4 of top_k guesses while prefetch is on
    # (the referee may have turned it off, staging slots and all, by the end) and pins the
    # share its warm-up session learned (none in 8 tokens), out of the same total.
    total = naive["cache_slots"]["dynamic_slots"]
    assert naive["cache_slots"] == {"pinned_slots": 0, "staging_slots": 0, "dynamic_slots": total}
    end = report["at_end_of_last_run"]
    staging = 1 if end["mechanisms"]["prefetch"] else 0
    assert report["cache_slots"] == {"pinned_slots": 0, "staging_slots": staging,
                                     "dynamic_slots": total - staging}
    assert end["policy"] == "default" and end["pin_share"] == 0.0
    assert set(end["mechanisms"]) == {"prefetch", "idle_prefetch", "early_hints", "policy", "lrfu"}
    assert naive["at_end_of_last_run"] == {"pinned_slots": 0, "staging_slots": 0,
                                           "pinned_experts": 0, "policy": "lru"}


def test_flops_per_token_counts_top_k_experts_only(model_dir):
    c = load_config(model_dir)
    H, D, I = c.hidden_size, c.head_dim, c.moe_intermediate_size
    attn = H * D * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    per_layer = attn + c.num_experts * H + c.top_k * 3 * H * I
    assert flops_per_token(c) == 2.0 * (2 * per_layer + c.vocab_size * H)


def test_cli_prints_json_only_on_stdout(model_dir, capsys):
    assert main(["bench", "--model", str(model_dir), "--expert-cache-bytes", "200K",
                 "--tokens", "4", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert KEYS <= set(json.loads(out))


def test_the_saved_storage_probe_is_reported_beside_the_roofline(model_dir, capsys, tmp_path,
                                                                   monkeypatch):
    from daemon.store.probe import block_device, report_path
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    rows = [{"mode": "direct", "queue_depth": qd, "gb_per_s": gb}
            for qd, gb in ((1, 0.4), (2, 0.7), (4, 0.9))]
    shard = sorted(model_dir.glob("*.safetensors"))[0]
    report_path(tmp_path, block_device(shard)).write_text(
        json.dumps({"device": "vdx", "io_path": "direct", "results": rows}))
    assert main(["bench", "--model", str(model_dir), "--expert-cache-bytes", "200K",
                 "--tokens", "4", "--repeats", "1", "--threads", "1", "--io-workers", "2"]) == 0
    probe = json.loads(capsys.readouterr().out)["storage_probe"]
    assert probe == {"io_path": "direct", "device": "vdx", "gb_per_s_at_io_workers": 0.7,
                     "best_gb_per_s": 0.9, "best_queue_depth": 4}
