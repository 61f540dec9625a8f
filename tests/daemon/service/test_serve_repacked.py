"""`moed serve` on a repacked (int4) model says so, and which numerics it runs — the ready
log line, /v1/models and moed_build_info — and streams the tokens the in-process model
generates under the same numerics."""
from __future__ import annotations

import pytest
from daemon_proc import in_process_greedy, serve_and_complete

from daemon.commands.cli import main
from ext.makemodel import make_model

PROMPT = [5, 9, 77, 3, 41]


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-int4")
    src = make_model(root / "bf16", arch="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64,
                     intermediate=64, dtype="bf16", seed=1, initializer_range=0.1)
    assert main(["repack", "--model", str(src), "--scheme", "int4", "--out", str(root / "int4"),
                 "--shard-size", "32K"]) == 0
    return root / "int4"


def test_serve_says_the_scheme_and_streams_the_same_tokens(int4_dir):
    run = serve_and_complete(int4_dir, PROMPT, 8)
    ready = run["ready"]
    assert (ready["expert_format"], ready["dense_format"], ready["quant_method"]) == (
        "int4", "bf16", "moed")
    assert ready["quantization"]["label"] == "int4-g32-min"
    weights = run["models"]["data"][0]["weights"]
    assert weights["experts"] == "int4"
    assert weights["quantization"] == {"quant_method": "moed", "scheme": "int4",
                                       "group_size": 32, "min": True,
                                       "label": "int4-g32-min", "dense": None}
    assert run["build_info"]["quantization"] == "int4"
    # The default, auto, resolves to fast for int4 experts, and every report says so.
    assert (ready["numerics"], ready["numerics_configured"]) == ("fast", "auto")
    assert weights["numerics"] == run["build_info"]["numerics"] == "fast"
    out = run["completion"]
    assert (out["usage"]["completion_tokens"], out["choices"][0]["text"]) == \
        in_process_greedy(int4_dir, PROMPT, 8, numerics="fast")
    assert out["usage"]["completion_tokens"] == 8


def test_serve_with_exact_numerics_reports_and_runs_exact(int4_dir):
    run = serve_and_complete(int4_dir, PROMPT, 8, "--numerics", "exact")
    ready = run["ready"]
    assert (ready["numerics"], ready["numerics_configured"]) == ("exact", "exact")
    assert run["models"]["data"][0]["weights"]["numerics"] == "exact"
    assert run["build_info"]["numerics"] == "exact"
    out = run["completion"]
    assert (out["usage"]["completion_tokens"], out["choices"][0]["text"]) == \
        in_process_greedy(int4_dir, PROMPT, 8, numerics="exact")
