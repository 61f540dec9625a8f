"""A standard OpenAI-compatible load generator (NVIDIA's aiperf, from PyPI) against
`moed serve` over loopback TCP, at several concurrencies and expert-cache sizes.

For each expert-cache size (a fraction of all routed experts' bytes; 1.0 holds them all)
this starts `moed serve --tcp-address 127.0.0.1:PORT --api-key KEY
--expert-cache-bytes SIZE` and, for each concurrency, runs

    aiperf profile --url http://127.0.0.1:PORT --api-key KEY --endpoint-type chat
        --streaming --concurrency N --request-count N*R --tokenizer ...

and reports aiperf's own figures from its profile_export_aiperf.json: time to first token,
inter-token latency, output tokens/s and requests/s (avg, p50, p99 where aiperf gives
them). Prompts are aiperf's synthetic ones (--input-tokens tokens of its corpus, counted
by the model's tokenizer); every answer is --output-tokens long (ignore_eos).

aiperf counts tokens with a Hugging Face tokenizer it loads by repository name; with no
Hub in reach, the model's tokenizer files are laid out as a local Hub cache (a private
HF_HOME) and aiperf runs with HF_HUB_OFFLINE=1. Install it with the bench extra:
`pip install -e '.[bench]'` (aiperf is pinned there; it is not a moed dependency).

    python bench/load_generator.py [--model DIR] [--concurrency 1,4,16]
        [--cache-fractions 0.25,1.0] [--requests-per-stream 4]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from served import ensure_model, serve

MAKE_MODEL = ["--arch", "qwen3_moe", "--layers", "8", "--experts", "32", "--top-k", "4",
              "--hidden", "256", "--intermediate", "256", "--seed", "5"]
HUB_REPO = "local/moed-bench"
REVISION = "0" * 40


def hub_cache(model_dir: str, hf_home: str) -> str:
    """Lay the model's tokenizer files out as the Hub cache does (refs/main -> a snapshot)
    so that an offline `AutoTokenizer.from_pretrained(HUB_REPO)` finds them."""
    repo = Path(hf_home, "hub", "models--" + HUB_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(Path(model_dir, name), snapshot / name)
    return HUB_REPO


def all_experts_bytes(model_dir: str) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from daemon.service.loading import plan_serving_memory
    return plan_serving_memory(model_dir, max_concurrent_sequences=1, pin_fraction=0.5).all_experts_bytes


def _figures(export: dict) -> dict:
    def pick(name: str, keys=("avg", "p50", "p99")) -> dict:
        metric = export.get(name) or {}
        return {k: metric.get(k) for k in keys if k in metric} | {"unit": metric.get("unit")}
    return {"time_to_first_token": pick("time_to_first_token"),
            "inter_token_latency": pick("inter_token_latency"),
            "request_latency": pick("request_latency"),
            "output_token_throughput": pick("output_token_throughput", ("avg",)),
            "output_token_throughput_per_user": pick("output_token_throughput_per_user"),
            "request_throughput": pick("request_throughput", ("avg",)),
            "request_count": pick("request_count", ("avg",)),
            "errors": export.get("error_summary")}


def run_aiperf(aiperf: str, d: dict, model_name: str, tokenizer: str, hf_home: str,
               concurrency: int, requests: int, args, outdir: str) -> dict:
    env = dict(os.environ, HF_HOME=hf_home, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [aiperf, "profile", "--model", model_name, "--url", d["url"], "--api-key", d["api_key"],
           "--endpoint-type", "chat", "--streaming", "--tokenizer", tokenizer,
           "--concurrency", str(concurrency), "--request-count", str(requests),
           "--warmup-request-count", str(concurrency),
           "--prompt-input-tokens-mean", str(args.input_tokens), "--prompt-input-tokens-stddev", "0",
           "--prompt-output-tokens-mean", str(args.output_tokens),
           "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
           "--random-seed", "7", "--ui-type", "none", "--no-gpu-telemetry",
           "--output-artifact-dir", outdir]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"aiperf exited with {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return json.loads(Path(outdir, "profile_export_aiperf.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-load-model",
                   help="model directory (written by make-model when missing)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts")
    p.add_argument("--cache-fractions", default="0.25,1.0",
                   help="expert cache sizes as fractions of all experts' bytes")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--aiperf", default=str(Path(sys.executable).with_name("aiperf")),
                   help="the aiperf executable (default: beside this Python)")
    args = p.parse_args()
    if not Path(args.aiperf).exists() and shutil.which(args.aiperf) is None:
        p.error(f"{args.aiperf} not found: pip install -e '.[bench]' (or give --aiperf)")
    levels = [int(c) for c in args.concurrency.split(",")]
    model = ensure_model(args.model, MAKE_MODEL)
    total = all_experts_bytes(model)
    version = subprocess.run([args.aiperf, "--version"], capture_output=True, text=True).stdout.strip()
    report = {"model": model, "make_model": MAKE_MODEL, "aiperf": version or "unknown",
              "all_experts_bytes": total, "input_tokens": args.input_tokens,
              "output_tokens": args.output_tokens, "transport": "HTTP over loopback TCP",
              "runs": []}
    workdir = tempfile.mkdtemp(prefix="moedaiperf", dir="/tmp")
    try:
        hf_home = os.path.join(workdir, "hf")
        tokenizer = hub_cache(model, hf_home)
        for fraction in (float(f) for f in args.cache_fractions.split(",")):
            cache = int(total * fraction)
            extra = ["--expert-cache-bytes", str(cache), "--max-concurrent-sequences", str(max(levels)),
                     "--max-queue", str(max(levels) * args.requests_per_stream)]
            if args.threads:
                extra += ["--threads", str(args.threads)]
            with serve(model, *extra) as d:
                for n in levels:
                    export = run_aiperf(args.aiperf, d, Path(model).name, tokenizer, hf_home, n,
                                        n * args.requests_per_stream, args,
                                        os.path.join(workdir, f"c{fraction}-n{n}"))
                    report["runs"].append({"expert_cache_fraction": fraction,
                                           "expert_cache_bytes": cache, "concurrency": n,
                                           **_figures(export)})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
