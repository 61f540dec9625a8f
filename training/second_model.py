"""Train moed's second small model: an OLMoE on the Perl standard library (the held-out check).

    python training/second_model.py --out /tmp/moed-perl-model [--steps 500] [--seed 0]

Why a second model. moed's defaults (pins, prefetch, staging, the eviction policy, the
do-no-harm controller) were chosen on the embedded default model (Python code), the
Kimi trace and `make-model` checkpoints. This model is for checking them on a workload
they were never tuned on: another language, another architecture (OLMoE: RMSNorm over
the whole q/k projections, unnormalised top-k weights), another routing width (64
experts, top_k 8). Never tune a default on it. It is not shipped (`moed bench --model
DIR` reads it from where this script wrote it); a rerun on the same Perl, Python and
library versions writes the same files (every step is seeded).

Needs the test extra (torch, transformers) and Perl's standard library on disk (on
Debian, package ``perl-modules-5.*``: ``/usr/share/perl/<version>``). The steps are those
of `training/default_model.py` (its tokenizer, training loop and evaluation), with:

1. Corpus: every ``*.pm`` file under `perl_library()` (the newest version there),
   minus test directories; the modules in `HELD_OUT` are kept for evaluation only (and
   are the prompt text of the benchmarks: `held_out_text`).
2. Model: `transformers.OlmoeForCausalLM` (`model_config`): 8 layers, hidden 128, 64
   experts of moe_intermediate 32 (24 KB each in bf16), top_k 8; saved in bf16.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import default_model as recipe  # noqa: E402  (the shared steps)

PERL_ROOT = Path("/usr/share/perl")
HELD_OUT = ("Getopt/Long.pm", "Text/Wrap.pm", "Text/ParseWords.pm", "Text/Balanced.pm",
            "File/Find.pm", "File/Temp.pm", "File/Copy.pm", "Math/BigInt.pm",
            "Pod/Usage.pm", "Tie/File.pm", "Benchmark.pm", "Dumpvalue.pm")
EXCLUDED_PARTS = {"t", "test", "tests", "Test", "Test2", "TAP", "unicore"}
PROMPTS = ("sub ", "my $", "package ")


def perl_library(root: Path = PERL_ROOT) -> Path:
    """The newest ``<root>/<version>`` directory holding ``*.pm`` files.

    Raises FileNotFoundError naming `root` when there is none."""
    versions = sorted((p for p in root.glob("5.*") if p.is_dir() and next(p.rglob("*.pm"), None)),
                      key=lambda p: [int(x) if x.isdigit() else 0 for x in p.name.split(".")])
    if not versions:
        raise FileNotFoundError(f"no Perl standard library (*.pm files) under {root}")
    return versions[-1].resolve()


def model_config(aux_coef: float):
    """The second model's architecture (see the module docstring)."""
    import transformers
    return transformers.OlmoeConfig(
        vocab_size=recipe.VOCAB_SIZE, hidden_size=128, intermediate_size=32,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        router_aux_loss_coef=aux_coef, output_router_logits=False,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
        initializer_range=0.02, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=0, pad_token_id=0)


def corpus_files(root: Path) -> tuple[Path, list[str], list[str]]:
    return recipe.corpus_files(root, "*.pm", HELD_OUT, EXCLUDED_PARTS)


def held_out_text(root: Path | None = None, limit_bytes: int | None = None) -> str:
    """The held-out modules joined (the benchmarks' prompt source), at most limit_bytes."""
    root, _, held = corpus_files(root or perl_library())
    text = "".join(recipe.read_texts(root, held))
    return text if limit_bytes is None else text[:limit_bytes]


def describe_corpus(root: Path, train: list[str], held: list[str]) -> dict:
    return {"perl_library": str(root), "excluded": sorted(EXCLUDED_PARTS),
            **recipe.file_lists(root, train, held)}


def write_model_card(out: Path, report: dict, corpus: dict) -> None:
    ev = report["evaluation"]
    routing = ev["routing"]
    text = f"""# moed's second model: a small OLMoE trained on the Perl standard library

A held-out check for moed's defaults (written by `training/second_model.py`; not shipped).
`OlmoeForCausalLM`, 8 layers, hidden 128, 64 routed experts of moe_intermediate 32, top_k 8,
vocabulary {recipe.VOCAB_SIZE} (byte-level BPE trained on the corpus).

Corpus: the `*.pm` files of {corpus['perl_library']} minus test directories:
{len(corpus['train_files'])} files ({corpus['train_bytes']:,} bytes) for training,
{len(corpus['held_out_files'])} held out ({corpus['held_out_bytes']:,} bytes):
{', '.join(f'`{f}`' for f in corpus['held_out_files'])}. Perl's modules are under the
Artistic License or the GPL, as Perl itself; so is this model, as a work derived from them.

Training: {report['steps']} steps of {report['batch']} x {report['seq_len']} tokens, AdamW, peak
learning rate {report['lr']:g}, per-layer load-balancing loss {report['aux_coef']:g}, f32 on
{report['threads']} threads, {report['seconds'] / 60:.1f} minutes; final loss
{report['history'][-1]['lm_loss']:.3f} nats per token.

Held out: {ev['held_out_tokens']:,} tokens, bits per byte {ev['bits_per_byte']['model']}
(unigram {ev['bits_per_byte']['unigram']}, lzma {ev['bits_per_byte']['lzma']}).

Routing on the held-out text, per layer: top 25 % share {routing['top25_share']};
previous-token reuse {routing['previous_token_reuse']}; next layer's router on the
post-attention state, recall at top_k {routing['next_layer_recall']['width_8']}; the
layer's own router on its input before attention, recall at top_k
{routing['own_router_before_attention_recall']['width_8']}.
"""
    (out / "README.md").write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--perl-root", type=Path, default=PERL_ROOT,
                        help=f"where Perl's versioned library directories are (default {PERL_ROOT})")
    recipe.add_training_arguments(parser, steps=500)
    args = parser.parse_args(argv)
    log = recipe.log

    import torch
    torch.set_num_threads(args.threads)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    root, train_names, held_names = corpus_files(perl_library(args.perl_root))
    corpus = describe_corpus(root, train_names, held_names)
    log(f"corpus: {len(train_names)} training files ({corpus['train_bytes']} bytes), "
        f"{len(held_names)} held out ({corpus['held_out_bytes']} bytes)")
    train_texts = recipe.read_texts(root, train_names)
    held_texts = recipe.read_texts(root, held_names)
    t_start = time.perf_counter()
    tok = recipe.train_tokenizer(train_texts)
    recipe.save_tokenizer(tok, out)
    (out / "training_files.json").write_text(json.dumps(corpus, indent=1) + "\n")
    stream = recipe.encode_stream(tok, train_texts)
    log(f"training stream: {len(stream)} tokens")
    model, report = recipe.train(stream, args, log, model_config(args.aux_coef))
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out)
    report["tokenizer_and_training_seconds"] = round(time.perf_counter() - t_start, 1)
    report["training_stream_tokens"] = int(len(stream))
    report["evaluation"] = recipe.evaluate(out, held_texts, stream, args.seq_len, log)
    report["samples_greedy_transformers"] = recipe.samples(out, PROMPTS)
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    write_model_card(out, report, corpus)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
