"""`moed serve` on an FP8 checkpoint: it says which format it serves (the ready log line,
/v1/models, moed_build_info) and its streamed completion is the in-process one."""
from __future__ import annotations

import shutil

import pytest
from daemon_proc import Daemon, short_dir
from metrics_scrape import parse

from daemon.store.streaming import minimum_cache_bytes
from ext.formats.checkpoint import Checkpoint
from ext.generate import Generation
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.models.model import Model
from ext.sampling import SamplingParams
from ext.tokenizer import Tokenizer

PROMPT = [5, 9, 77, 3, 41]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("serve-fp8") / "fp8-model", arch="qwen2_moe",
                      layers=2, experts=8, top_k=2, hidden=96, intermediate=80, dtype="fp8",
                      scale_dtype="bf16", shard_size=100_000, seed=1, initializer_range=0.1)


def test_serve_says_the_format_and_streams_the_same_tokens(fp8_dir):
    config = load_config(fp8_dir)
    budget = minimum_cache_bytes(ExpertLayout(Checkpoint(fp8_dir), config), config)
    workdir = short_dir()
    d = Daemon(fp8_dir, workdir, "--expert-cache-bytes", str(budget), "--threads", "1")
    try:
        (ready,) = [e for e in d.events if e["event"] == "ready"]
        assert (ready["expert_format"], ready["dense_format"], ready["quant_method"]) == (
            "fp8_e4m3", "mixed", "fp8")
        status, models = d.json("GET", "/v1/models")
        assert status == 200
        weights = models["data"][0]["weights"]
        assert weights["experts"] == "fp8_e4m3"
        # attention, shared experts: FP8; routers, shared-expert gates, lm_head: bf16
        assert weights["dense_formats"] == {"bf16": 2 * 2 + 1, "fp8_e4m3": 2 * (4 + 3)}
        assert weights["quantization"] == {"quant_method": "fp8", "fmt": "e4m3",
                                           "weight_block_size": [128, 128],
                                           "activation_scheme": "dynamic", "scale_fmt": "float"}
        _, _, body = d.request("GET", "/metrics")
        _, samples = parse(body.decode())
        build = [labels for (name, labels) in samples if name == "moed_build_info"]
        assert dict(build[0])["quantization"] == "fp8_e4m3"
        status, out = d.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                                         "temperature": 0})
        assert status == 200
        assert d.stop() == 0
    finally:
        d.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
    model = Model.load(fp8_dir, n_threads=1)
    expected = list(Generation(model, PROMPT, max_tokens=8, sampling=SamplingParams(temperature=0.0),
                               stop_ids=()))
    model.close()
    assert out["usage"]["completion_tokens"] == len(expected) == 8
    assert out["choices"][0]["text"] == Tokenizer.from_model_dir(fp8_dir).decode(expected)
