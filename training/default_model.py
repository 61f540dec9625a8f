"""Train moed's embedded default model: a small Qwen3-MoE on the Python standard library.

    python training/default_model.py --out daemon/default_model [--steps 1800] [--seed 0]

Needs the test extra (torch, transformers). Runs on the CPU; the shipped model took the
time its model card gives on 2 cores. CI never runs this script: the trained model is
committed as package data (`daemon/default_model/`), and `tests/ext/test_default_model.py`
checks it against transformers.

What it does, in order (every step seeded, so a rerun on the same interpreter gives the
same files):

1. Corpus: every ``*.py`` file of the standard library of the interpreter running the
   script (``sysconfig.get_paths()["stdlib"]``), minus tests, ``site-packages``, the
   codec tables of ``encodings/`` and ``pydoc_data/`` (generated data, not code). The
   modules in `HELD_OUT` are kept for evaluation only. The file list, its SHA-256 and
   the Python version go to ``training_files.json``.
2. Tokenizer: byte-level BPE (`tokenizers`), `VOCAB_SIZE` ids, ``<|endoftext|>`` = id 0
   between files; saved as ``tokenizer.json`` + ``tokenizer_config.json`` with a chat
   template for code completion (message contents concatenated, the model continues).
3. Model: `transformers.Qwen3MoeForCausalLM` (`model_config`), trained in f32 with
   AdamW on random windows of `--seq-len` tokens, with ``output_router_logits=True`` so
   the load-balancing loss (coefficient `--aux-coef`) applies; saved in bf16.
4. Evaluation on the held-out modules (`evaluate`): bits per byte of the model (bf16
   weights, computed in f32), of a unigram token model fitted on the training text, and
   of ``lzma`` (preset 9 | extreme); routing statistics per layer: share of selections
   taken by the top 25 % of experts, previous-token reuse (share of a token's experts
   also chosen by the token before it), and the recall of moed's next-layer predictor
   (layer l+1's router applied to layer l's post-attention normed hidden state, top
   ``top_k`` and ``2 * top_k``). Written to ``training_report.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

VOCAB_SIZE = 4096
EOS = "<|endoftext|>"
# Modules kept out of training, for evaluation (paths relative to the stdlib directory;
# a directory holds out everything under it).
HELD_OUT = ("argparse.py", "calendar.py", "csv.py", "dataclasses.py", "difflib.py",
            "fnmatch.py", "fractions.py", "glob.py", "heapq.py", "json/", "shlex.py",
            "statistics.py", "string.py", "textwrap.py")
EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data",
                  "__pycache__"}
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '# ' + message['content'] + '\\n' }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
)


def model_config(aux_coef: float):
    """The shipped architecture. Sizes: see the model card (why these)."""
    import transformers
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64,
        intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, router_aux_loss_coef=aux_coef, output_router_logits=False,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
        initializer_range=0.02, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=0, pad_token_id=0,
    )


# ------------------------------------------------------------------------- corpus
def corpus_files(root: Path | None = None, pattern: str = "*.py",
                 held_out: tuple[str, ...] = HELD_OUT,
                 excluded: set[str] = EXCLUDED_PARTS) -> tuple[Path, list[str], list[str]]:
    """(corpus dir, training files, held-out files), relative POSIX paths, sorted.

    Defaults: the standard library of this interpreter, its ``*.py`` files, `HELD_OUT`,
    `EXCLUDED_PARTS` (training/second_model.py passes another corpus)."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    train, held = [], []
    for path in sorted(root.rglob(pattern)):
        rel = path.relative_to(root)
        if excluded & set(rel.parts[:-1]) or rel.parts[0].startswith("test"):
            continue
        name = rel.as_posix()
        (held if any(name == h or (h.endswith("/") and name.startswith(h)) for h in held_out)
         else train).append(name)
    return root, train, held


def read_texts(root: Path, names: list[str]) -> list[str]:
    return [(root / n).read_text(encoding="utf-8", errors="replace") for n in names]


def file_lists(root: Path, train: list[str], held: list[str]) -> dict:
    """The training and held-out file lists with their SHA-256 digests and sizes."""
    def digest(names):
        h = hashlib.sha256()
        for n in names:
            h.update(n.encode() + b"\0" + (root / n).read_bytes() + b"\0")
        return h.hexdigest()
    return {"train_files": train, "held_out_files": held,
            "train_sha256": digest(train), "held_out_sha256": digest(held),
            "train_bytes": sum((root / n).stat().st_size for n in train),
            "held_out_bytes": sum((root / n).stat().st_size for n in held)}


def describe_corpus(root: Path, train: list[str], held: list[str]) -> dict:
    return {"python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "stdlib": "sysconfig.get_paths()['stdlib']", "excluded": sorted(EXCLUDED_PARTS),
            **file_lists(root, train, held)}


# ---------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS) == 0
    return tok


def save_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024,
        "bos_token": None, "eos_token": EOS, "pad_token": EOS, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """Token ids of the texts, each followed by EOS (id 0), as one uint16 stream."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(0)
    return np.asarray(ids, np.uint16)


# -------------------------------------------------------------------------- train
def layer_balancing_loss(router_logits, cfg):
    """Mean over MoE layers of the Switch Transformer load-balancing loss
    (Fedus et al. 2021, eq. 4, with top-k selections as in transformers'
    `load_balancing_loss_func`), each layer balanced on its own. 1.0 = uniform."""
    import torch
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    total = 0.0
    for logits in router_logits:                                 # [tokens, E] per layer
        probs = torch.softmax(logits.float(), -1)
        chosen = torch.topk(probs, K, -1).indices
        fraction = torch.zeros(E).scatter_add_(0, chosen.reshape(-1),
                                               torch.ones(chosen.numel())) / chosen.numel()
        total = total + E * torch.sum(fraction * probs.mean(0))
    return total / len(router_logits)


def top_quarter_shares(router_logits, cfg) -> list[float]:
    """Per layer, the share of top-k selections taken by the top 25 % of experts."""
    import torch
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    shares = []
    for logits in router_logits:
        counts = torch.bincount(torch.topk(logits.detach(), K, -1).indices.reshape(-1), minlength=E)
        shares.append(round(float(torch.sort(counts, descending=True).values[:E // 4].sum()
                                  / counts.sum()), 2))
    return shares


def model_class(config):
    """The transformers causal-LM class of `config` (Qwen3-MoE here, OLMoE for the second
    model)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def train(stream: np.ndarray, args, log, cfg=None) -> tuple[object, dict]:
    """Train a model of `cfg` (default: `model_config(args.aux_coef)`) on `stream`."""
    import torch
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    cfg = model_config(args.aux_coef) if cfg is None else cfg
    model = model_class(cfg)(cfg).float()
    # The balancing loss is added per layer below (`layer_balancing_loss`), not by
    # transformers over all layers pooled, which lets each layer collapse onto its own
    # few experts as long as the layers pick different ones.
    model.router_aux_loss_coef = 0.0
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, args.steps // 20)

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    rng = np.random.default_rng(args.seed)
    data = torch.from_numpy(stream.astype(np.int64))
    history = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        starts = rng.integers(0, len(stream) - args.seq_len, size=args.batch)
        batch = torch.stack([data[s:s + args.seq_len] for s in starts])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=batch, labels=batch, output_router_logits=True)  # labels shift inside
        aux = layer_balancing_loss(out.router_logits, cfg)
        loss = out.loss + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            lm, aux = float(out.loss.detach()), float(aux.detach())
            shares = top_quarter_shares(out.router_logits, cfg)
            elapsed = time.perf_counter() - t0
            history.append({"step": step, "lm_loss": round(lm, 4), "aux_loss": round(aux, 4),
                            "top25_share": shares, "elapsed_s": round(elapsed, 1)})
            log(f"step {step}/{args.steps} lm_loss {lm:.3f} aux {aux:.3f} top25 {shares} "
                f"{(step + 1) * args.batch * args.seq_len / elapsed:.0f} tok/s")
    seconds = time.perf_counter() - t0
    return model, {"steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
                   "tokens": args.steps * args.batch * args.seq_len, "lr": args.lr,
                   "aux_coef": args.aux_coef, "seed": args.seed, "threads": args.threads,
                   "seconds": round(seconds, 1), "history": history}


# ----------------------------------------------------------------------- evaluate
def evaluate(model_dir: Path, held_texts: list[str], train_stream: np.ndarray,
             seq_len: int, log) -> dict:
    """Bits per byte and routing statistics of the saved model on the held-out texts."""
    import torch
    import transformers
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    c = model.config
    n_bytes = sum(len(t.encode("utf-8")) for t in held_texts)
    stream = encode_stream(tok, held_texts)
    ids = torch.from_numpy(stream.astype(np.int64))

    # Capture, per layer, the router's input (the post-attention normed hidden state).
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, args, out, l=l: inputs.__setitem__(l, args[0].reshape(-1, c.hidden_size)))
        for l, layer in enumerate(model.model.layers)]
    # ... and each layer's input (the previous layer's output), for the guess made before
    # the layer's attention: its own router on its input through its post-attention norm.
    layer_inputs: dict[int, torch.Tensor] = {}
    hooks += [layer.register_forward_pre_hook(
        lambda mod, args, kwargs, l=l: layer_inputs.__setitem__(
            l, (args[0] if args else kwargs["hidden_states"]).reshape(-1, c.hidden_size)),
        with_kwargs=True) for l, layer in enumerate(model.model.layers)]
    nats, n_pred = 0.0, 0
    L, E, K = c.num_hidden_layers, c.num_experts, c.num_experts_per_tok
    counts = np.zeros((L, E), np.int64)
    reuse_hits = np.zeros(L, np.int64)
    reuse_total = 0
    recall = {K: np.zeros(L - 1, np.int64), 2 * K: np.zeros(L - 1, np.int64)}
    own_recall = {K: np.zeros(L, np.int64), 2 * K: np.zeros(L, np.int64)}
    n_routed = 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, seq_len):
            chunk = ids[s:s + seq_len + 1]
            if len(chunk) < 2:
                break
            out = model(input_ids=chunk[None, :-1])
            logp = torch.log_softmax(out.logits[0].float(), -1)
            nats -= float(logp.gather(1, chunk[1:, None]).sum())
            n_pred += len(chunk) - 1
            chosen = []
            for l in range(L):
                h = inputs[l]
                router = model.model.layers[l].mlp.gate.weight
                logits = h @ router.T
                chosen.append(torch.topk(logits, K, -1).indices.numpy())
            for l in range(L):
                np.add.at(counts[l], chosen[l].ravel(), 1)
                prev, cur = chosen[l][:-1], chosen[l][1:]
                reuse_hits[l] += sum(len(set(a) & set(b)) for a, b in zip(prev, cur))
            reuse_total += (len(chosen[0]) - 1) * K
            n_routed += len(chosen[0])
            for l in range(L - 1):
                nxt = model.model.layers[l + 1].mlp.gate.weight
                pred_logits = inputs[l] @ nxt.T
                for width in recall:
                    pred = torch.topk(pred_logits, width, -1).indices.numpy()
                    recall[width][l] += sum(len(set(p) & set(a)) for p, a in zip(pred, chosen[l + 1]))
            for l in range(L):
                layer = model.model.layers[l]
                own_logits = layer.post_attention_layernorm(layer_inputs[l]) @ layer.mlp.gate.weight.T
                for width in own_recall:
                    pred = torch.topk(own_logits, width, -1).indices.numpy()
                    own_recall[width][l] += sum(len(set(p) & set(a)) for p, a in zip(pred, chosen[l]))
    for h in hooks:
        h.remove()

    # Baselines: a unigram token model (add-one smoothing) fitted on the training stream,
    # and lzma over the raw held-out bytes.
    freq = np.bincount(train_stream, minlength=VOCAB_SIZE).astype(np.float64) + 1.0
    logp_uni = np.log2(freq / freq.sum())
    unigram_bits = -float(logp_uni[stream[1:]].sum())
    raw = "".join(held_texts).encode("utf-8")
    lzma_bits = 8.0 * len(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    top = max(1, E // 4)
    share = [float(np.sort(counts[l])[::-1][:top].sum() / counts[l].sum()) for l in range(L)]
    report = {
        "held_out_bytes": n_bytes, "held_out_tokens": int(len(stream)),
        "bytes_per_token": round(n_bytes / len(stream), 3),
        "loss_nats_per_token": round(nats / n_pred, 4),
        "bits_per_byte": {"model": round(nats / math.log(2) / n_bytes, 4),
                          "unigram": round(unigram_bits / n_bytes, 4),
                          "lzma": round(lzma_bits / len(raw), 4)},
        "routing": {
            "top25_share": [round(x, 3) for x in share],
            "previous_token_reuse": [round(float(x) / reuse_total, 3) for x in reuse_hits],
            "next_layer_recall": {f"width_{w}": [round(float(x) / (n_routed * K), 3) for x in r]
                                  for w, r in recall.items()},
            "own_router_before_attention_recall": {
                f"width_{w}": [round(float(x) / (n_routed * K), 3) for x in r]
                for w, r in own_recall.items()},
        },
    }
    log(json.dumps(report))
    return report


def samples(model_dir: Path, prompts: tuple[str, ...], n: int = 48) -> dict[str, str]:
    import torch
    import transformers
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    found = {}
    for p in prompts:
        ids = torch.tensor([tok.encode(p, add_special_tokens=False).ids])
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=0, pad_token_id=0)
        found[p] = tok.decode(out[0].tolist())
    return found


def write_model_card(out: Path, report: dict, corpus: dict) -> None:
    """README.md of the model directory, from the training report (figures as measured)."""
    ev = report["evaluation"]
    bpb = ev["bits_per_byte"]
    routing = ev["routing"]
    cfg = json.loads((out / "config.json").read_text())
    # transformers 5 writes num_local_experts and rope_parameters for this family
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    size = (out / "model.safetensors").stat().st_size
    rows = "\n".join(
        f"| {l} | {routing['top25_share'][l]:.3f} | {routing['previous_token_reuse'][l]:.3f} | "
        + (f"{routing['next_layer_recall']['width_4'][l - 1]:.3f} | "
           f"{routing['next_layer_recall']['width_8'][l - 1]:.3f} |" if l else "– | – |")
        for l in range(len(routing["top25_share"])))
    samples = "\n\n".join(f"`{p!r}` →\n\n```python\n{t}\n```"
                           for p, t in report["samples_greedy_transformers"].items())
    last = report["history"][-1]
    text = f"""# moed's default model: a small Qwen3-MoE trained on the Python standard library

`moed demo` serves this model. It completes Python code. It is small enough to ship inside
the package ({size / 1e6:.2f} MB of bf16 safetensors) and has real, learned routing, so the
expert cache, the learned pins and the prefetch predictor have something to learn.

## Architecture

`Qwen3MoeForCausalLM` (transformers' own class; moed matches it token for token, see
`tests/ext/test_default_model.py`): {cfg['num_hidden_layers']} layers, hidden
{cfg['hidden_size']}, {cfg['num_attention_heads']} attention heads of {cfg['head_dim']} with
{cfg['num_key_value_heads']} key/value heads, {cfg['num_experts']} routed experts per layer
(moe_intermediate {cfg['moe_intermediate_size']}), top_k {cfg['num_experts_per_tok']},
`norm_topk_prob` {str(cfg['norm_topk_prob']).lower()}, vocabulary {cfg['vocab_size']},
tied input/output embeddings, RoPE theta {cfg['rope_theta']:g}, trained at
{report['seq_len']} tokens of context. Why these sizes: 32 experts of top_k 4 per layer
make caching matter (a quarter of the experts is 2 x top_k slots per layer); hidden 128 and
moe_intermediate 64 keep the experts ({cfg['num_experts']} x 3 x 128 x 64 per layer) at
{cfg['num_hidden_layers'] * cfg['num_experts'] * 3 * 128 * 64 * 2 / 1e6:.1f} MB of the
total, inside the 15.5 MB the package may carry (moe_intermediate 128 would be 28 MB);
tying the embeddings saves 1 MB, which keeps the whole file under that bound.

## Data

The `*.py` files of the standard library of CPython {corpus['python']} (the interpreter
that ran the training), minus tests, `site-packages`, the codec tables of `encodings/`
and `pydoc_data/`: {len(corpus['train_files'])} files, {corpus['train_bytes']:,} bytes
for training; {len(corpus['held_out_files'])} files ({corpus['held_out_bytes']:,} bytes)
held out for evaluation: {', '.join(f'`{f}`' for f in corpus['held_out_files'])}. The file
list and SHA-256 digests are in `training_files.json`. The text is under the Python
Software Foundation License (PSF-2.0); so is this model, as a work derived from it.

Tokenizer: byte-level BPE trained with `tokenizers` on the training files, {cfg['vocab_size']}
ids, `<|endoftext|>` = 0 between files; its chat template hands the messages over as code
to continue (a system message becomes a `# ` comment line).

## Training

`training/default_model.py` (seeded; `python training/default_model.py --out DIR`):
AdamW (betas 0.9/0.95, weight decay 0.1), peak learning rate {report['lr']:g} with
warm-up and cosine decay to 10 %, {report['steps']} steps of {report['batch']} x
{report['seq_len']} tokens = {report['tokens']:,} tokens (about
{report['tokens'] / report['training_stream_tokens']:.1f} passes over the
{report['training_stream_tokens']:,}-token training stream), in f32 on
{report['threads']} CPU threads: {report['seconds'] / 60:.1f} minutes of training,
{report['tokenizer_and_training_seconds'] / 60:.1f} minutes with the tokenizer. Router
logits were output (`output_router_logits=True`) and a load-balancing loss with
coefficient {report['aux_coef']:g} was applied per layer (the Switch Transformer loss of
each layer, averaged over layers — transformers' built-in version pools all layers, which
lets each layer collapse onto its own few experts). Final training loss
{last['lm_loss']:.3f} nats per token.

## Evaluation on the held-out files

{ev['held_out_tokens']:,} tokens, {ev['held_out_bytes']:,} bytes ({ev['bytes_per_token']}
bytes per token); model loss {ev['loss_nats_per_token']} nats per token.

| | bits per byte |
|---|---|
| this model | {bpb['model']} |
| unigram over its tokens (fitted on the training text) | {bpb['unigram']} |
| `lzma` (preset 9, extreme) | {bpb['lzma']} |

Routing on the held-out text (per layer: share of selections taken by the top 25 % of
experts; share of a token's experts the previous token also chose; recall of moed's
next-layer predictor for this layer — its router applied to the previous layer's
post-attention hidden state — at width top_k and 2 x top_k):

| layer | top 25 % share | previous-token reuse | recall @4 | recall @8 |
|---|---|---|---|---|
{rows}

Greedy completions (transformers, {48} new tokens) of three short prompts.
Each prompt ends in a space, so it ends on a lone space token, which the tokenizer rarely
produces inside code (a space merges with the word after it); a small greedy model also
repeats itself. `moed demo` samples at temperature 0.7 from `def fibonacci(n):` and a newline.

{samples}
"""
    (out / "README.md").write_text(text)


def add_training_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    """The training options both models' scripts take (defaults: the shipped runs)."""
    parser.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default {steps})")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--aux-coef", type=float, default=0.003,
                        help="router_aux_loss_coef, the load-balancing loss weight (default 0.003)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")


def log(msg: str) -> None:
    """A progress line on stderr, with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    add_training_arguments(parser, steps=1800)
    parser.add_argument("--eval-only", action="store_true", help="evaluate an already trained --out")
    args = parser.parse_args(argv)

    import torch
    torch.set_num_threads(args.threads)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    root, train_names, held_names = corpus_files()
    corpus = describe_corpus(root, train_names, held_names)
    log(f"corpus: {len(train_names)} training files ({corpus['train_bytes']} bytes), "
        f"{len(held_names)} held out ({corpus['held_out_bytes']} bytes), Python {corpus['python']}")
    train_texts = read_texts(root, train_names)
    held_texts = read_texts(root, held_names)
    t_start = time.perf_counter()
    if not args.eval_only:
        tok = train_tokenizer(train_texts)
        save_tokenizer(tok, out)
        (out / "training_files.json").write_text(json.dumps(corpus, indent=1) + "\n")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    stream = encode_stream(tok, train_texts)
    log(f"training stream: {len(stream)} tokens")
    report_path = out / "training_report.json"
    if args.eval_only:
        report = json.loads(report_path.read_text())
    else:
        model, report = train(stream, args, log)
        model.config.output_router_logits = False
        model.to(torch.bfloat16).save_pretrained(out)
        report["tokenizer_and_training_seconds"] = round(time.perf_counter() - t_start, 1)
        report["training_stream_tokens"] = int(len(stream))
    report["evaluation"] = evaluate(out, held_texts, stream, args.seq_len, log)
    report["samples_greedy_transformers"] = samples(out, ("def ", "class ", "import "))
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    write_model_card(out, report, json.loads((out / "training_files.json").read_text()))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
