"""`moed serve` on a repacked (int4) model says so — the ready log line, /v1/models and
moed_build_info — and streams the tokens the in-process model generates."""
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
    out = run["completion"]
    assert (out["usage"]["completion_tokens"], out["choices"][0]["text"]) == \
        in_process_greedy(int4_dir, PROMPT, 8)
    assert out["usage"]["completion_tokens"] == 8
