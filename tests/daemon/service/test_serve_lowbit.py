"""`moed serve` on an FP8 checkpoint: it says which format it serves (the ready log line,
/v1/models, moed_build_info) and its streamed completion is the in-process one."""
from __future__ import annotations

import pytest
from daemon_proc import in_process_greedy, serve_and_complete

from ext.makemodel import make_model

PROMPT = [5, 9, 77, 3, 41]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("serve-fp8") / "fp8-model", arch="qwen2_moe",
                      layers=2, experts=8, top_k=2, hidden=96, intermediate=80, dtype="fp8",
                      scale_dtype="bf16", shard_size=100_000, seed=1, initializer_range=0.1)


def test_serve_says_the_format_and_streams_the_same_tokens(fp8_dir):
    run = serve_and_complete(fp8_dir, PROMPT, 8)
    ready = run["ready"]
    assert (ready["expert_format"], ready["dense_format"], ready["quant_method"]) == (
        "fp8_e4m3", "mixed", "fp8")
    weights = run["models"]["data"][0]["weights"]
    assert weights["experts"] == "fp8_e4m3"
    # attention, shared experts: FP8; routers, shared-expert gates, lm_head: bf16
    assert weights["dense_formats"] == {"bf16": 2 * 2 + 1, "fp8_e4m3": 2 * (4 + 3)}
    assert weights["quantization"] == {"quant_method": "fp8", "fmt": "e4m3",
                                       "weight_block_size": [128, 128],
                                       "activation_scheme": "dynamic", "scale_fmt": "float"}
    assert run["build_info"]["quantization"] == "fp8_e4m3"
    # The default, auto, resolves to exact: fast numerics changes no FP8 weight.
    assert (ready["numerics"], ready["numerics_configured"]) == ("exact", "auto")
    assert weights["numerics"] == run["build_info"]["numerics"] == "exact"
    out = run["completion"]
    assert (out["usage"]["completion_tokens"], out["choices"][0]["text"]) == \
        in_process_greedy(fp8_dir, PROMPT, 8, numerics="exact")
    assert out["usage"]["completion_tokens"] == 8
