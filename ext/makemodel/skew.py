"""The routing-skew construction of make_model(routing_skew=S): realistic routing for
cache benchmarks, by editing rows of the random tensors (chunk by chunk, numpy only).

Why plain random weights are not a uniform baseline: with std 0.02 the attention output
is about 0.02 * H times an embedding row and, being an average over the context, nearly
the same vector for every token; it dominates the residual stream from layer 1 on, so
the routers see almost one hidden state. Measured (moed engine, 300 sampled tokens,
T = 0.7, qwen3_moe): at S = 0 the top 25 % of experts take 0.43-1.00 of the selections
per layer (mean 0.79-0.97), previous-token reuse is 0.13-0.96 (mean 0.53-0.86), i.e.
layer 0 near uniform and deeper layers stuck on a few experts. A near-uniform baseline
is the construction below at a vanishing skew (S = 0.001: top 25 % 0.31-0.33, reuse
0.14-0.17, against 0.25 and top_k / E for exact uniformity plus sampling noise).

Construction (S > 0). n0 = initializer_range * sqrt(H) is the norm of a random row;
u, w_1..w_C (C = min(16, H // 4)) are orthonormal directions drawn from the seed, and
every non-special token v gets a random topic c(v).
1. Private channel. Embedding row v = its random part with the u and topic components
   removed (rescaled back to norm n0) + alpha n0 u + b n0 w_c(v), alpha = 1, b = 4.
   Every matrix that reads the normalised hidden state — q/k/v, expert gate/up, the
   shared expert and its gate, lm_head and the routers' random part — has the u and
   topic components removed from its rows. Attention and experts never see u or the
   topic; only the rows set below do.
2. Known residual growth. With x_rest the residual stream without its u and topic
   parts: o_proj is scaled by kappa_o / (std sqrt(Nq D H) s), expert down_proj by
   kappa_d / (sqrt(I) a m) and the qwen2_moe shared expert's by kappa_d / (sqrt(S) a / 2),
   where s = |h_rest| / sqrt(H) at the layer, a = rms of silu(z) y for z, y ~ N(0,
   (std sqrt(H) s)^2), m = E|routing weights|_2 (simulated with the offsets below).
   kappa_o = 0.5 (attention spreads over the context: it adds ~0.1 n0 per layer,
   rho_a = 0.3 measured), kappa_d = 0.8 (routed output 0.68-0.80 n0 per layer measured).
   Then E|x_rest|^2 before layer l = n0^2 (1 + g l), g = (0.3 kappa_o)^2 + n kappa_d^2
   (n = 2 for qwen2_moe), and (h . u) / sqrt(H) = cos_l = alpha / sqrt(alpha^2 + b^2
   + 1 + g l + (0.3 kappa_o)^2) — measured cos agrees within 0.01 over 24 layers.
3. Popularity. Router row e of layer l = its projected random part
   + lam_l std sum_c y[l, e, c] w_c + o[l, e] / (sqrt(H) cos_l) u, so that its logit is
   o[l, e] + a noise of sd sigma_l (random part + topic part, both known from 2.).
   o[l, e] = sigma_l * Phi^-1(top_k * share(rank_l(e))), share(r) proportional to
   r^-S, clipped at 0.97 / top_k (an expert is chosen at most once per token) with the
   excess spread over the other ranks; rank_l a random permutation per layer. In the
   mean-field limit (the top_k-th logit taken as constant) expert e is chosen with
   probability Phi(o / sigma) = top_k * share: popularity follows rank^-S. Checked by
   simulation (20 000 tokens) for E = 8..256, top_k = 2..8, S = 0.5..2: mean |log| error
   of the shares 0.01-0.17, fitted exponent within 0.08 of the clipped law's.
4. Reuse. lm_head row v gets gamma w_c(v): the current topic's tokens get a logit bonus
   Delta, solved so that the next token stays in the topic with probability 0.8 at
   T = 0.7 (measured 0.81-0.83). The topic rows of the routers (lam_l) make a share
   rho^2 of the router-logit noise shared within a topic; y is standardised per expert
   over the topics, so popularity over many topics is unchanged. rho is solved per
   shape by simulating the topic chain (per-token noise fixed per token id, as in the
   model) so that previous-token reuse at S = 1 is 0.40; rho = 0 when popularity alone
   reaches 0.40 (E / top_k <= ~8). lam_l accounts for x_rest's spill onto the C topic
   directions (C (|x_rest|^2 / n0^2 - 1) / H); b = 4 keeps that spill small.
Cost: two small matrix products per written row of the projected tensors plus
simulations of well under a second: 403 M parameters (8 x 1024 x 64 experts x 256)
took 2.6-2.7 s plain and 2.8-2.9 s skewed (2 CPUs).

Measured (moed's Model, n_threads=2, Generation with SamplingParams(temperature=0.7),
300 decode tokens, ids recorded from ext.kernels._kernels.route; per-layer range [mean];
"top 25 %" = share of selections taken by the top quarter of experts, "exponent" =
least-squares slope of log share vs log rank, "reuse" = share of a token's experts also
chosen by the previous token, "next" = top_k recall of the next layer's router applied
to this layer's hidden state):
    shape (arch L H E k)          S  top 25 %          exponent          reuse             next
    qwen3_moe 4 256 32 4          0  0.43-0.99 [0.79]  0.55-2.34 [1.66]  0.18-0.77 [0.53]  0.36
    qwen3_moe 4 256 32 4          1  0.66-0.72 [0.69]  1.03-1.19 [1.12]  0.39-0.43 [0.41]  0.75
    qwen3_moe 8 512 64 8          0  0.52-1.00 [0.92]  0.79-2.19 [1.73]  0.22-0.89 [0.76]  0.54
    qwen3_moe 8 512 64 8          1  0.68-0.73 [0.70]  1.02-1.15 [1.08]  0.41-0.44 [0.42]  0.79
    qwen3_moe 12 512 64 4         0  0.60-1.00 [0.96]  0.99-2.64 [1.94]  0.17-0.91 [0.75]  0.60
    qwen3_moe 12 512 64 4         1  0.72-0.77 [0.75]  1.15-1.35 [1.25]  0.40-0.48 [0.44]  0.82
    qwen3_moe 16 1024 64 8        0  0.60-1.00 [0.97]  0.68-2.29 [1.64]  0.28-0.96 [0.86]  0.64
    qwen3_moe 16 1024 64 8        1  0.68-0.72 [0.70]  1.01-1.15 [1.07]  0.39-0.43 [0.42]  0.83
    qwen3_moe 8 512 256 8         1  0.80-0.83 [0.81]  1.13-1.23 [1.18]  0.38-0.41 [0.40]  0.79
    mixtral 8 256 8 2             1  0.54-0.64 [0.58]  0.96-1.31 [1.13]  0.41-0.55 [0.47]  0.82
    olmoe 8 512 64 8              1  0.66-0.72 [0.70]  1.03-1.15 [1.10]  0.40-0.45 [0.43]  0.80
    qwen2_moe 8 384 48 4          1  0.67-0.73 [0.72]  1.11-1.35 [1.21]  0.39-0.47 [0.44]  0.77
    qwen3_moe 8 512 64 8        0.5  0.46-0.49 [0.48]  0.54-0.63 [0.59]  0.18-0.21 [0.19]  0.72
    qwen3_moe 8 512 64 8          2  0.88-0.91 [0.89]  1.71-1.79 [1.75]  0.64-0.68 [0.66]  0.87
For comparison, exact Zipf(1) drawn independently for 300 tokens reads exponent 1.01
(64/8) to 1.09 (64/4), top 25 % 0.68-0.72, reuse 0.40 (64/8), 0.29 (64/4), 0.38 (32/4);
the clipped Zipf(2) law itself has exponent 1.69 (64/8). The fit over a few hundred
tokens reads ~0.1 high where rho is large (64/4: 1.15 over 1500 tokens; the same
chain simulated without a model reads 1.11). The real Kimi-Linear trace in
../shared/traces (256 experts, top-8, 300 tokens) reads top 25 % 0.65-0.87,
exponent 0.92-1.32, reuse 0.22-0.45 (mean 0.34), median reuse distance 3 tokens (S = 1
here: 2 tokens; published: 2-3). Over 12 seeds (model and sampling, 256 tokens) the
4/256/32/4 shape stays within top 25 % 0.64-0.73, exponent 0.99-1.27, reuse 0.39-0.44
per layer; at S = 0.001 within 0.31-0.35, 0.20-0.31, 0.11-0.18.
Constants, and the measurement behind each (8-layer 512/64/8 unless said):
kappa_o 0.5 — at 1.5 attention's context average compounds layer on layer again
(earlier variant: reuse 0.57-0.59, exponent 1.6-1.8 in layers 5-7). kappa_d 0.8 — 0.5
gave mean next-layer recall 0.81-0.82; 0.8 gives 0.75-0.83 (0.70-0.91 per layer, rising
with depth; published one layer ahead: ~0.72). b 4 and C 16 — with b = 0.5 the spill
made the topic share fall with depth (reuse 0.43 at layer 0, 0.27-0.35 in layers 9-11
of 12/512/64/4); with C = 64 (8 tokens per topic at vocab 512) tokens repeated within a
topic and reuse overshot to 0.48-0.52. alpha 1: any value works (offsets are scaled by
cos_l). Stay 0.8: a topic lasts ~5 tokens. A 24-layer 512/64/8 model keeps top 25 %
0.68-0.73, exponent 1.02-1.24, reuse 0.41-0.44 in every layer.

Frontier families (deepseek_v3, glm4_moe, gpt_oss), the same construction with:
- What reads h: MLA's q_proj or q_a_proj and kv_a_proj_with_mqa (q_b and kv_b read
  RMS-normed latents, not h), the dense MLPs of the first_k_dense_replace layers and the
  shared experts; GPT-OSS's fused gate_up_proj, whose plain [E, H, 2I] layout reads h
  along columns (projected per expert; its chunks hold whole experts) and MXFP4's
  [E, 2I, H] along rows.
- Residual growth per layer: attention + routed (or dense) + the ungated shared experts
  of DeepSeek-V3 / GLM-4.5 (kappa_d each); MLA's o_proj is scaled against values
  kv_b_proj(latent) of norm std sqrt(Nq v_head_dim kv_lora_rank); the dense MLP's and
  shared experts' down_proj by kappa_d / (sqrt(width) a). a is GPT-OSS's clamped SwiGLU
  rms where it applies ((clip(up) + 1) gate sigmoid(1.702 gate)).
- Biases that add the same vector to every token's residual stream (GPT-OSS's o_proj and
  experts' down_proj biases, the v_proj biases of GLM-4.5 and GPT-OSS, whose values
  attention passes on whole) and GPT-OSS's router bias are zero: random ones of norm n0
  per layer were left out of the growth above and made popularity drift (GPT-OSS
  exponent 1.45-2.17, reuse up to 0.61, next-layer recall 0.59-0.78 with them).
- Routing rule. GPT-OSS picks the top_k logits, as the softmax families do: the same
  offsets. For DeepSeek-V3 / GLM-4.5 (sigmoid + correction bias + groups) the offsets
  are solved by fixed-point iteration on simulated choices so the rule picks each rank
  at its share, with an e_score_correction_bias leaning against popularity as the
  trained one does (-0.5 x (sigmoid(offset) - its mean)): the hint must apply the bias
  and the groups to predict well. m is simulated under each rule (routed_scaling_factor
  included).
Measured as above (moed's Model, 255 decode steps at T = 0.7, next = recall of the
family's own prefetch hint; per-layer range [mean]):
    shape (arch L H E k)          S  top 25 %          exponent          reuse             next
    deepseek_v3 5 256 32 4        1  0.63-0.70 [0.66]  1.05-1.12 [1.10]  0.37-0.43 [0.40]  0.66-0.75
    deepseek_v3 5 256 32 4    0.001  0.32-0.35 [0.33]  0.25-0.33 [0.28]  0.13-0.14 [0.13]  0.56-0.67
    deepseek_v3 5 256 32 4        2  0.84-0.90 [0.87]  1.60-1.87 [1.74]  0.58-0.66 [0.62]  0.82-0.84
    deepseek_v3 6 512 64 8        1  0.63-0.72 [0.67]  0.95-1.14 [1.06]  0.36-0.43 [0.39]  0.63-0.81
    deepseek_v3 fp8, no q_lora    1  0.63-0.67 [0.65]  0.98-1.16 [1.05]  0.35-0.41 [0.37]  0.65-0.77
    glm4_moe 5 256 32 4           1  0.64-0.73 [0.69]  1.03-1.31 [1.19]  0.38-0.44 [0.41]  0.67-0.78
    glm4_moe 5 256 32 4       0.001  0.33 [0.33]       0.24-0.29 [0.27]  0.13-0.16 [0.14]  0.53-0.69
    glm4_moe 6 512 64 8           1  0.69-0.73 [0.70]  1.00-1.23 [1.10]  0.39-0.43 [0.40]  0.68-0.80
    gpt_oss 5 256 32 4            1  0.65-0.71 [0.68]  1.06-1.25 [1.15]  0.38-0.42 [0.40]  0.66-0.80
    gpt_oss 5 256 32 4        0.001  0.33-0.36 [0.34]  0.24-0.35 [0.28]  0.15-0.18 [0.16]  0.56-0.69
    gpt_oss 6 512 64 8            1  0.69-0.72 [0.71]  1.03-1.16 [1.12]  0.41-0.43 [0.42]  0.69-0.80
    gpt_oss mxfp4 5 256 32 4      1  0.67-0.73 [0.69]  1.10-1.37 [1.21]  0.40-0.43 [0.42]  0.63-0.79
(qwen3_moe 5 256 32 4 at S = 1 in the same run: 0.67-0.72, 1.03-1.36, 0.40-0.45, 0.70-0.80.)
"""
from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np

from ext.makemodel.shards import RowAdjust
from ext.makemodel.tokenizer import SPECIAL_TOKENS

# The construction's constants, calibrated by measurement: the module doc says how and with
# what result.
_SKEW_EMBED = 1.0         # alpha: |u component| / |random part| of an embedding row
_SKEW_TOPICS = 16         # C: token topics (at most hidden // 4)
_SKEW_TOPIC = 4.0         # b: |topic component| / |random part| of an embedding row
_SKEW_STAY = 0.8          # P(next token in the current topic) at _SKEW_TEMPERATURE
_SKEW_ATTN = 0.5          # kappa_o: |o_proj output| / |random part of a row|, one position attended
_SKEW_ATTN_SPREAD = 0.3   # rho_a: measured |attention output| / that (attention spreads out)
_SKEW_FFN = 0.8           # kappa_d: |routed experts' output| (and shared expert's) / |random part|
_SKEW_REUSE = 0.40        # previous-token reuse aimed at for routing_skew = 1
_SKEW_TEMPERATURE = 0.7   # sampling temperature that the topic persistence is set for
_SKEW_CAP = 0.97          # an expert's share is at most _SKEW_CAP / top_k


def _skew_rng(seed: int, label: str) -> np.random.Generator:
    """A random stream of the routing-skew construction, independent of the tensors' streams."""
    digest = hashlib.sha256(("routing_skew/" + label).encode("utf-8")).digest()
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *struct.unpack("<4Q", digest)])))


def _norm_ppf(q: np.ndarray) -> np.ndarray:
    """Inverse standard normal CDF, by bisection on math.erf (|error| < 1e-12)."""
    cdf = np.vectorize(lambda x: 0.5 * (1.0 + math.erf(x / math.sqrt(2.0))))
    lo, hi = np.full(q.shape, -12.0), np.full(q.shape, 12.0)
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        below = cdf(mid) < q
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return 0.5 * (lo + hi)


def _zipf_shares(E: int, top_k: int, skew: float) -> np.ndarray:
    """Share of the top_k selections taken by each rank: rank^-skew normalised, clipped at
    _SKEW_CAP / top_k (an expert is chosen at most once per token) with the excess spread
    over the other ranks in proportion. Uniform when the clip cannot be met."""
    if E * _SKEW_CAP <= top_k:
        return np.full(E, 1.0 / E)
    share = np.arange(1, E + 1, dtype=np.float64) ** -skew
    share /= share.sum()
    capped = np.zeros(E, bool)
    while True:
        over = (share > _SKEW_CAP / top_k) & ~capped
        if not over.any():
            return share
        capped |= over
        share[capped] = _SKEW_CAP / top_k
        share[~capped] *= (1.0 - share[capped].sum()) / share[~capped].sum()


def _zipf_offsets(E: int, top_k: int, skew: float) -> np.ndarray:
    """Router-logit offsets by rank, in units of the logit noise: top_k of offset + N(0, 1)
    then picks rank r with probability ~ top_k * share_r. Mean field: the top_k-th largest
    logit is taken as a constant (0), so P(r chosen) = Phi(offset_r)."""
    if top_k >= E:
        return np.zeros(E)
    return _norm_ppf(top_k * _zipf_shares(E, top_k, skew))


def _simulated_reuse(offsets: np.ndarray, top_k: int, rho: float, topics: int, per_topic: int,
                     tokens: int = 3000) -> float:
    """Previous-token reuse of top_k(offsets + sqrt(1 - rho^2) z_token + rho y_topic), z and y
    standard normal and fixed per token id and per topic: the topic is a Markov chain that
    keeps its topic with probability _SKEW_STAY and otherwise moves to one of the others,
    the token is drawn uniformly from the topic's per_topic tokens."""
    rng = np.random.Generator(np.random.PCG64(0))
    E = offsets.size
    per_topic = min(per_topic, 256)                          # repeats are rare beyond that
    z = rng.standard_normal((topics * per_topic, E))
    y = rng.standard_normal((topics, E))
    keep = rng.random(tokens) < _SKEW_STAY
    jump = rng.integers(1, max(topics, 2), tokens)
    topic = np.zeros(tokens, np.int64)
    for t in range(1, tokens):
        topic[t] = topic[t - 1] if keep[t] else (topic[t - 1] + jump[t]) % topics
    token = topic * per_topic + rng.integers(0, per_topic, tokens)
    logits = offsets + math.sqrt(1.0 - rho * rho) * z[token] + rho * y[topic]
    chosen = np.zeros((tokens, E), bool)
    np.put_along_axis(chosen, np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k], True, axis=1)
    return float((chosen[1:] & chosen[:-1]).sum() / ((tokens - 1) * top_k))


def _topic_correlation(E: int, top_k: int, topics: int, per_topic: int) -> float:
    """rho, the topic's share (as a correlation) of the router-logit noise, that gives
    _SKEW_REUSE at routing_skew 1; 0 when popularity alone already reaches it."""
    if top_k >= E:
        return 0.0
    offsets = _zipf_offsets(E, top_k, 1.0)
    lo, hi = 0.0, 0.95
    if _simulated_reuse(offsets, top_k, lo, topics, per_topic) >= _SKEW_REUSE:
        return 0.0
    for _ in range(12):
        mid = 0.5 * (lo + hi)
        if _simulated_reuse(offsets, top_k, mid, topics, per_topic) < _SKEW_REUSE:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _topic_bonus(topics: int, leak: float) -> float:
    """Logit bonus Delta of the current topic's tokens that keeps the topic with probability
    _SKEW_STAY at _SKEW_TEMPERATURE, when every topic's logits also carry a shared
    N(0, (leak * Delta)^2) noise (the bonus seen through a noisy direction)."""
    g = np.random.Generator(np.random.PCG64(2)).standard_normal((4096, topics))

    def stay(bonus: float) -> float:
        logits = bonus * leak * g
        logits[:, 0] += bonus
        p = np.exp((logits - logits.max(axis=1, keepdims=True)) / _SKEW_TEMPERATURE)
        return float((p[:, 0] / p.sum(axis=1)).mean())

    if topics < 2:
        return 0.0
    lo, hi = 0.0, 50.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if stay(mid) < _SKEW_STAY else (lo, mid)
    return 0.5 * (lo + hi)


def _silu_product_rms(s: float) -> float:
    """rms of silu(z) * y for independent z, y ~ N(0, s^2) (numerical quadrature)."""
    z = np.linspace(-8.0, 8.0, 4001) * s
    pdf = np.exp(-0.5 * (z / s) ** 2)
    silu = z / (1.0 + np.exp(-z))
    return math.sqrt(float((silu ** 2 * pdf).sum() / pdf.sum()) * s * s)


def _mixing_norm(offsets: np.ndarray, noise: float, top_k: int, renormalize: bool) -> float:
    """E|routing weights of one token|_2 for logits offsets + N(0, noise^2), by simulation."""
    rng = np.random.Generator(np.random.PCG64(1))
    logits = offsets[None, :] + noise * rng.standard_normal((256, offsets.size))
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    w = -np.sort(-p, axis=1)[:, :top_k]
    if renormalize:
        w /= w.sum(axis=1, keepdims=True)
    return float(np.sqrt((w ** 2).sum(axis=1)).mean())


def _zeroed(rows: np.ndarray, first_row: int) -> None:
    """A bias the construction sets to zero (the module doc, "Frontier families")."""
    rows[:] = 0.0


def _clamped_swiglu_rms(s: float) -> float:
    """rms of GPT-OSS's (clip(u, -7, 7) + 1) * g' sigmoid(1.702 g'), g' = min(g, 7), for
    independent g, u ~ N(0, s^2) (a fixed-seed Monte Carlo estimate)."""
    rng = np.random.Generator(np.random.PCG64(4))
    g, u = s * rng.standard_normal(200_000), s * rng.standard_normal(200_000)
    g = np.minimum(g, 7.0)
    act = (np.clip(u, -7.0, 7.0) + 1.0) * g / (1.0 + np.exp(-1.702 * g))
    return float(np.sqrt(np.mean(act ** 2)))


def _sigmoid_choice(logits: np.ndarray, bias: np.ndarray, top_k: int, n_group: int,
                    topk_group: int) -> np.ndarray:
    """[T, top_k] experts DeepSeek-V3's rule picks: sigmoid + bias, groups ranked by their
    two best, top_k of the kept groups (ext.models.routing.SigmoidGroupedTopK)."""
    T, E = logits.shape
    choice = 1.0 / (1.0 + np.exp(-logits)) + bias
    if topk_group < n_group:
        grouped = choice.reshape(T, n_group, E // n_group)
        top2 = -np.sort(-grouped, axis=2)[:, :, :2].sum(axis=2)
        dropped = np.argsort(-top2, axis=1, kind="stable")[:, topk_group:]
        np.put_along_axis(grouped, dropped[:, :, None].repeat(E // n_group, 2), -np.inf, axis=1)
    return np.argpartition(-choice, top_k - 1, axis=1)[:, :top_k]


def _sigmoid_offsets(shares: np.ndarray, sigma: float, top_k: int, n_group: int, topk_group: int,
                     balance: float, draws: int = 4000, rounds: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """(router-logit offsets [E], e_score_correction_bias [E]) under which DeepSeek-V3's
    rule, with logits offset + N(0, sigma^2), picks expert e with probability
    top_k x shares[e]. The bias leans against popularity as trained ones do (DeepSeek-V3
    learns it to balance load): bias = -balance x (sigmoid(offset) - its mean); the
    offsets are found by fixed-point iteration on simulated choices (fixed seed)."""
    E = shares.size
    rng = np.random.Generator(np.random.PCG64(5))
    z = sigma * rng.standard_normal((draws, E))
    want = np.clip(top_k * shares, 0.5 / draws, 1 - 0.5 / draws)
    target = _norm_ppf(want)
    offsets = sigma * target
    bias = np.zeros(E)
    for _ in range(rounds):
        sig = 1.0 / (1.0 + np.exp(-offsets))
        bias = -balance * (sig - sig.mean())
        counts = np.bincount(_sigmoid_choice(offsets + z, bias, top_k, n_group, topk_group).ravel(),
                             minlength=E)
        got = np.clip(counts / draws, 0.5 / draws, 1 - 0.5 / draws)
        offsets = offsets + 0.7 * sigma * (target - _norm_ppf(got))
    return offsets, bias


def _weights_norm(logits: np.ndarray, rule: str, top_k: int, renormalize: bool,
                  scaling: float, bias: np.ndarray | None = None, groups: tuple[int, int] = (1, 1)) -> float:
    """E|routing weights of one token|_2 under a family's rule for these sampled logits."""
    if rule == "sigmoid":
        ids = _sigmoid_choice(logits, bias, top_k, *groups)
        w = np.take_along_axis(1.0 / (1.0 + np.exp(-logits)), ids, axis=1)
        if renormalize:
            w = w / w.sum(axis=1, keepdims=True)
        w = w * scaling
    else:                                                    # top_k of the logits, softmaxed
        top = -np.sort(-logits, axis=1)[:, :top_k]
        w = np.exp(top - top[:, :1])
        w /= w.sum(axis=1, keepdims=True)
    return float(np.sqrt((w ** 2).sum(axis=1)).mean())


@dataclass(frozen=True)
class _Family:
    """What the construction needs to know of an architecture's checkpoint."""

    moe: str                     # the MoE block ("mlp", "block_sparse_moe")
    router: str                  # the router module under it
    experts: tuple[str, str, str] | None   # per-expert gate, up, down names; None: fused
    rule: str                    # "softmax" | "sigmoid" | "topk_softmax"
    attention: str               # "gqa" | "mla"
    activation: str              # "swiglu" | "clamped_swiglu"


_FAMILIES = {
    "mixtral": _Family("block_sparse_moe", "gate", ("w1", "w3", "w2"), "softmax", "gqa", "swiglu"),
    "qwen2_moe": _Family("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "softmax", "gqa", "swiglu"),
    "qwen3_moe": _Family("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "softmax", "gqa", "swiglu"),
    "olmoe": _Family("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "softmax", "gqa", "swiglu"),
    "deepseek_v3": _Family("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "sigmoid", "mla", "swiglu"),
    "glm4_moe": _Family("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "sigmoid", "gqa", "swiglu"),
    "gpt_oss": _Family("mlp", "router", None, "topk_softmax", "gqa", "clamped_swiglu"),
}
_BALANCE = 0.5    # how far the correction bias leans against popularity (0: no bias)


def skew_adjustments(arch: str, d: dict, top_k: int, seed: int, std: float,
                      skew: float) -> dict[str, RowAdjust]:
    """Per-tensor row edits of the routing-skew construction (the module doc),
    keyed by tensor name; every other tensor keeps its plain random values.

    The families differ in what reads the normed hidden state (attention's input
    projections, expert and shared-expert gate/up, dense MLPs, routers), in how large
    attention's output is (GQA: values are projections of h; MLA: of an RMS-normed
    latent), in the activation (GPT-OSS's clamped SwiGLU) and in the routing rule: for
    DeepSeek-V3 / GLM-4.5 the logit offsets are solved so that sigmoid + correction bias
    + groups picks experts with the Zipf shares, the bias leaning against popularity as
    a trained one does (`_sigmoid_offsets`); GPT-OSS's top-k of the logits is the
    softmax families' choice. d["fields"] holds the family's own config fields."""
    fam = _FAMILIES[arch]
    f = d.get("fields", {})
    H, E, I, L, V = d["H"], d["E"], d["I"], d["L"], d["V"]
    alpha, b = _SKEW_EMBED, _SKEW_TOPIC
    C = max(1, min(_SKEW_TOPICS, H // 4))
    basis = np.linalg.qr(_skew_rng(seed, "directions").standard_normal((H, 1 + C)))[0]
    basis = basis.astype(np.float32)                         # [H, 1 + C] orthonormal: u, w_1..w_C
    u = basis[:, 0]
    topics = np.zeros((C + 1, H), np.float32)                # row C: no topic (special tokens)
    topics[:C] = basis[:, 1:].T
    topics64 = topics.astype(np.float64)
    topic_of = np.full(V, C, np.int64)
    topic_of[len(SPECIAL_TOKENS):] = _skew_rng(seed, "topics").integers(0, C, V - len(SPECIAL_TOKENS))

    noise = std * math.sqrt(H)                               # n0 = |random part of a row|
    attn_out = _SKEW_ATTN_SPREAD * _SKEW_ATTN                # |attention output| / n0
    first_dense = f.get("first_k_dense_replace", 0)
    n_shared = f.get("n_shared_experts", 0)
    # FFN outputs added per layer: routed (or dense) + qwen2_moe's / DeepSeek's shared expert
    n_ffn = [1 + (arch == "qwen2_moe" or (n_shared > 0 and l >= first_dense)) for l in range(L)]
    growth = [attn_out ** 2 + n * _SKEW_FFN ** 2 for n in n_ffn]   # per layer, in n0^2

    def rest2(layer: int) -> float:
        """E|x_rest|^2 / n0^2 of the residual stream entering `layer`, x_rest being x
        without its u and topic components."""
        if len(set(growth)) == 1:                            # as the first families always had
            return 1.0 + growth[0] * layer
        return 1.0 + sum(growth[:layer])

    basis64 = basis.astype(np.float64)

    def project(rows: np.ndarray) -> None:                   # remove the u and topic components
        # In float64: a BLAS product's summation order depends on how many rows it is given
        # (its kernels differ by shape and CPU), and in float32 that changed bf16 values
        # between chunkings; in float64 the order's effect is far below float32 rounding.
        rows -= ((rows.astype(np.float64) @ basis64) @ basis64.T).astype(np.float32)

    def reader(rows: np.ndarray, first_row: int) -> None:
        project(rows)

    def column_reader(rows: np.ndarray, first_row: int) -> None:
        """GPT-OSS's plain experts [E, H, 2I] read h along their rows: per expert, remove
        the u and topic components of every column (the chunks hold whole experts)."""
        w = rows.reshape(-1, H, rows.shape[1])
        w -= np.einsum("hk,ekc->ehc", basis64, np.einsum("hk,ehc->ekc", basis64, w)).astype(np.float32)

    column_reader.row_multiple = H

    def scaled(factor: float) -> RowAdjust:
        f32 = np.float32(factor)

        def adjust(rows: np.ndarray, first_row: int) -> None:
            rows *= f32
        return adjust

    shared = np.float32(alpha * noise) * u
    topic_embed = np.float32(b * noise) * topics
    restore = np.float32(math.sqrt(H / (H - 1 - C)))        # keep |random part| = n0

    def embed(rows: np.ndarray, first_row: int) -> None:
        project(rows)
        rows *= restore
        rows += shared
        rows += topic_embed[topic_of[first_row:first_row + rows.shape[0]]]

    # lm_head: + gamma w_topic(v), so the current topic's tokens get a logit bonus Delta. The
    # layers' outputs put x_rest partly along every topic direction: the bonus of each topic
    # then carries a shared noise of sd leak * Delta.
    final2 = alpha ** 2 + b * b + rest2(L)
    leak = math.sqrt((rest2(L) - 1.0) / H) / b
    bonus = _topic_bonus(C, leak)
    topic_head = np.float32(bonus * math.sqrt(final2) / (math.sqrt(H) * b)) * topics

    def head(rows: np.ndarray, first_row: int) -> None:
        project(rows)
        rows += topic_head[topic_of[first_row:first_row + rows.shape[0]]]

    out: dict[str, RowAdjust] = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    rho2 = _topic_correlation(E, top_k, C, max(1, (V - len(SPECIAL_TOKENS)) // C)) ** 2
    unit_offsets = _zipf_offsets(E, top_k, skew)             # by rank, in units of the noise
    shares = _zipf_shares(E, top_k, skew)
    renormalize = arch in ("mixtral", "qwen3_moe") or (fam.rule == "sigmoid" and f["norm_topk_prob"])
    moe = fam.moe
    for layer in range(L):
        p = f"model.layers.{layer}."
        r2a = rest2(layer)                                   # at this layer's attention
        r2 = r2a + attn_out ** 2                             # at its router and experts
        z2 = alpha ** 2 + b * b + r2                         # |x|^2 / n0^2
        sin_attn = math.sqrt(r2a / (alpha ** 2 + b * b + r2a))   # |h_rest| / sqrt(H)
        sin = math.sqrt(r2 / z2)
        cos = alpha / math.sqrt(z2)                          # (h . u) / sqrt(H)
        act = (_clamped_swiglu_rms if fam.activation == "clamped_swiglu" else _silu_product_rms)(
            std * math.sqrt(H) * sin)
        a = p + "self_attn."
        if fam.attention == "mla":
            out[a + ("q_proj" if f["q_lora_rank"] is None else "q_a_proj") + ".weight"] = reader
            out[a + "kv_a_proj_with_mqa.weight"] = reader
            # values: kv_b rows (std) against the RMS-normed latent (|latent| = sqrt(r))
            out[a + "o_proj.weight"] = scaled(
                _SKEW_ATTN / (std * math.sqrt(d["Nq"] * f["v_head_dim"] * f["kv_lora_rank"])))
        else:
            for proj in "qkv":
                out[f"{a}{proj}_proj.weight"] = reader
            if f.get("attention_bias"):                      # GLM-4.5, GPT-OSS (module doc)
                out[a + "v_proj.bias"] = _zeroed
            D = f.get("head_dim", d["D"])
            out[a + "o_proj.weight"] = scaled(_SKEW_ATTN / (std * math.sqrt(d["Nq"] * D * H) * sin_attn))
        if f.get("attention_bias") and arch != "glm4_moe":   # GLM-4.5 has no o_proj bias
            out[a + "o_proj.bias"] = _zeroed
        if layer < first_dense:                              # a dense MLP, no router
            S = f["intermediate_size"]
            out[p + "mlp.gate_proj.weight"] = reader
            out[p + "mlp.up_proj.weight"] = reader
            out[p + "mlp.down_proj.weight"] = scaled(_SKEW_FFN / (math.sqrt(S) * act))
            continue

        # Router-logit variance, in units of std^2 H / z2: plain rows r.h_rest give r2; the
        # topic rows lam * std * y[e, c] * w_c give lam2 b^2 shared within the topic, and
        # lam2 C (r2 - 1) / H per token from x_rest's components along the topic directions.
        spill = C * (r2 - 1.0) / H
        share = min(rho2, 0.9 * b * b / (b * b + spill))
        lam2 = share * r2 / (b * b - share * (b * b + spill))
        sigma = std * math.sqrt(H / z2) * math.sqrt(r2 + lam2 * (b * b + spill))   # its sd
        rank = _skew_rng(seed, f"rank/{layer}").permutation(E)            # rank[e]: 0 = hottest
        if fam.rule == "softmax":
            offsets = unit_offsets[rank] * sigma
            mix = _mixing_norm(offsets, sigma, top_k, renormalize)
        elif fam.rule == "topk_softmax":
            offsets = unit_offsets[rank] * sigma
            logits = offsets + sigma * np.random.Generator(np.random.PCG64(1)).standard_normal((256, E))
            mix = _weights_norm(logits, "topk_softmax", top_k, True, 1.0)
        else:
            groups = (f["n_group"], f["topk_group"])
            by_rank, bias_by_rank = _sigmoid_offsets(shares, sigma, top_k, *groups, _BALANCE)
            offsets, bias = by_rank[rank], bias_by_rank[rank]
            logits = offsets + sigma * np.random.Generator(np.random.PCG64(1)).standard_normal((256, E))
            mix = _weights_norm(logits, "sigmoid", top_k, renormalize, f["routed_scaling_factor"],
                                bias, groups)
            bias32 = bias.astype(np.float32)

            def correction(rows: np.ndarray, first_row: int, bias32: np.ndarray = bias32) -> None:
                rows[:] = bias32

            out[f"{p}{moe}.{fam.router}.e_score_correction_bias"] = correction

        down = scaled(_SKEW_FFN / (math.sqrt(I) * act * mix))
        if fam.experts is None:                              # GPT-OSS: fused over experts
            e = f"{p}{moe}.experts."
            out[e + "gate_up_proj"] = reader if d.get("rows_out") else column_reader
            out[e + "down_proj"] = down
            out[e + "down_proj_bias"] = _zeroed
            out[f"{p}{moe}.{fam.router}.bias"] = _zeroed
        else:
            for e in range(E):
                pe = f"{p}{moe}.experts.{e}."
                out[pe + fam.experts[0] + ".weight"] = reader
                out[pe + fam.experts[1] + ".weight"] = reader
                out[pe + fam.experts[2] + ".weight"] = down
        if arch == "qwen2_moe":                              # sigmoid(gate . h) ~ 0.5
            out[p + "mlp.shared_expert.gate_proj.weight"] = reader
            out[p + "mlp.shared_expert.up_proj.weight"] = reader
            out[p + "mlp.shared_expert.down_proj.weight"] = scaled(
                _SKEW_FFN / (math.sqrt(d["S"]) * act * 0.5))
            out[p + "mlp.shared_expert_gate.weight"] = reader
        elif n_shared:                                       # DeepSeek-V3 / GLM-4.5: ungated
            out[p + "mlp.shared_experts.gate_proj.weight"] = reader
            out[p + "mlp.shared_experts.up_proj.weight"] = reader
            out[p + "mlp.shared_experts.down_proj.weight"] = scaled(
                _SKEW_FFN / (math.sqrt(n_shared * I) * act))

        y = _skew_rng(seed, f"topic_router/{layer}").standard_normal((E, C))
        if C > 1:                                            # so each expert's mean over topics is
            y -= y.mean(axis=1, keepdims=True)               # its offset: popularity over many
            y /= y.std(axis=1, keepdims=True)                # topics stays rank^-S
        topic_w = (math.sqrt(lam2) * std * y).astype(np.float32)          # [E, C]
        u_w = (offsets / (math.sqrt(H) * cos)).astype(np.float32)          # [E]

        def router(rows: np.ndarray, first_row: int, topic_w: np.ndarray = topic_w,
                   u_w: np.ndarray = u_w) -> None:
            span = slice(first_row, first_row + rows.shape[0])
            project(rows)
            rows += (topic_w[span].astype(np.float64) @ topics64[:C]).astype(np.float32)
            rows += np.outer(u_w[span], u)

        out[f"{p}{moe}.{fam.router}.weight"] = router
    return out
