"""Kernels of the DeepSeek-V3, GLM-4.5 and GPT-OSS forward passes against numpy
references written from transformers' definitions: grouped sigmoid routing,
top-k-then-softmax routing, partial and interleaved RoPE, attention sinks, latent (MLA)
attention, per-head products, and GPT-OSS's fused expert FFN (interleaved gate/up,
biases, clamped SwiGLU, plain [in, out] or MXFP4 weights). Agreement is checked against
float64; the determinism promises (threads, batch composition) bit for bit. Each test of
a rule that engines have got wrong also shows that the wrong rule gives another answer.
"""
import ml_dtypes
import numpy as np
import pytest
from quant_reference import dequantize_fp8, dequantize_mxfp4, random_fp8, random_mxfp4

from ext.kernels import _kernels as kern

THREADS = [1, 2]
threads = pytest.mark.parametrize("n_threads", THREADS)


def _rng(*key):
    return np.random.default_rng([20250716, *key])


def _f32(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ------------------------------------------------------------- grouped sigmoid routing


def grouped_reference(logits, bias, n_group, topk_group, top_k, renormalize, scaling):
    """transformers' DeepseekV3TopkRouter in float64, with ties to the lower id."""
    T, E = logits.shape
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias
    G = E // n_group
    ids = np.zeros((T, top_k), np.int64)
    weights = np.zeros((T, top_k))
    for t in range(T):
        c = choice[t].copy()
        if topk_group < n_group:
            top2 = np.sort(c.reshape(n_group, G), axis=1)[:, -2:].sum(axis=1)
            kept = sorted(range(n_group), key=lambda g: (-top2[g], g))[:topk_group]
            for g in range(n_group):
                if g not in kept:
                    c[g * G:(g + 1) * G] = -np.inf
        order = sorted(range(E), key=lambda e: (-c[e], e))[:top_k]
        ids[t] = order
        w = scores[t, order]
        if renormalize:
            w = w / (w.sum() + 1e-20)
        weights[t] = w * scaling
    return ids, weights


def _route_grouped(logits, bias, n_group, topk_group, top_k, renormalize=True, scaling=2.5):
    T = logits.shape[0]
    ids = np.full((T, top_k), -1, np.int32)
    weights = np.full((T, top_k), np.nan, np.float32)
    kern.route_grouped(np.ascontiguousarray(logits, np.float32), np.ascontiguousarray(bias, np.float32),
                       n_group, topk_group, top_k, renormalize, scaling, ids, weights)
    return ids, weights


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (8, 4), (8, 3), (4, 4), (16, 2)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_grouped_matches_the_reference(n_group, topk_group, renormalize):
    rng = _rng(1, n_group, topk_group)
    logits = _f32(rng, (64, 64), 2.0)
    bias = _f32(rng, (64,), 0.5)
    ids, weights = _route_grouped(logits, bias, n_group, topk_group, 8, renormalize)
    want_ids, want_w = grouped_reference(logits, bias.astype(np.float64), n_group, topk_group, 8,
                                         renormalize, 2.5)
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=2e-6, atol=0)


def test_correction_bias_chooses_but_does_not_weigh():
    """The bias moves expert 3 (lower raw score) into the top 2; its weight is its own
    unbiased sigmoid score. Adding the bias to the weights — a bug seen in engines —
    gives other weights."""
    logits = np.array([[2.0, 1.0, 0.0, 0.5]], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 0.5], np.float32)
    ids, weights = _route_grouped(logits, bias, 1, 1, 2, renormalize=False, scaling=1.0)
    s = 1 / (1 + np.exp(-logits[0].astype(np.float64)))
    assert ids[0].tolist() == [3, 0]                    # 0.62 + 0.5 > 0.88 > 0.73
    np.testing.assert_allclose(weights[0], s[[3, 0]], rtol=1e-6)
    assert not np.allclose(weights[0], (s + bias)[[3, 0]], rtol=1e-3)


def test_group_score_is_the_sum_of_the_two_best():
    """Group 0 holds the single best expert, group 1 the better pair: with one group
    kept, the top-2 sum keeps group 1 (ranking groups by their maximum would keep 0)."""
    p = np.array([0.95, 0.10, 0.80, 0.79], np.float64)
    logits = np.log(p / (1 - p)).astype(np.float32)[None]
    ids, _ = _route_grouped(logits, np.zeros(4, np.float32), 2, 1, 2, scaling=1.0)
    assert sorted(ids[0].tolist()) == [2, 3]
    assert 0.95 > 0.80 and 0.95 + 0.10 < 0.80 + 0.79     # what a max ranking would get wrong


def test_route_grouped_ties_go_to_the_lower_id():
    logits = np.zeros((1, 8), np.float32)
    ids, _ = _route_grouped(logits, np.zeros(8, np.float32), 4, 2, 3)
    assert ids[0].tolist() == [0, 1, 2]                  # groups 0 and 1 tie with 2 and 3


def test_route_grouped_refuses_what_cannot_work():
    logits = np.zeros((2, 8), np.float32)
    bias = np.zeros(8, np.float32)
    for args, message in [((3, 1, 2), "n_group 3"), ((4, 5, 2), "topk_group 5"),
                          ((8, 4, 2), "cannot be ranked"), ((4, 1, 3), "exceeds the 2 experts")]:
        with pytest.raises(ValueError, match=message):
            _route_grouped(logits, bias, *args)
    with pytest.raises(ValueError, match="correction_bias"):
        _route_grouped(logits, np.zeros(7, np.float32), 1, 1, 2)
    with pytest.raises(ValueError, match="NaN"):
        _route_grouped(logits, np.full(8, np.nan, np.float32), 1, 1, 2)
    with pytest.raises(ValueError, match="NaN"):
        _route_grouped(np.full((2, 8), np.inf, np.float32), bias, 1, 1, 2)


# ------------------------------------------------------------- top-k, then softmax


def test_topk_then_softmax_matches_gpt_oss_and_differs_from_softmax_then_topk():
    rng = _rng(2)
    logits = _f32(rng, (32, 32), 3.0)
    ids = np.zeros((32, 4), np.int32)
    weights = np.zeros((32, 4), np.float32)
    kern.route_topk_softmax(logits, 4, ids, weights)
    order = np.argsort(-logits.astype(np.float64), axis=1, kind="stable")[:, :4]
    assert np.array_equal(ids, order)
    top = np.take_along_axis(logits.astype(np.float64), order, axis=1)
    want = np.exp(top - top.max(axis=1, keepdims=True))
    want /= want.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(weights, want, rtol=2e-6)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)
    all_probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    all_probs /= all_probs.sum(axis=1, keepdims=True)
    assert not np.allclose(weights, np.take_along_axis(all_probs, order, axis=1), rtol=1e-2)
    out, tied_w = np.zeros((1, 3), np.int32), np.zeros((1, 3), np.float32)
    kern.route_topk_softmax(np.zeros((1, 8), np.float32), 3, out, tied_w)
    assert out[0].tolist() == [0, 1, 2]                  # ties go to the lower id
    np.testing.assert_allclose(tied_w, 1 / 3, rtol=1e-6)


# ------------------------------------------------------------- rope: partial, interleaved


def _tables(T, half, theta=1e4):
    inv = theta ** (-np.arange(half) * 2.0 / (2 * half))
    ang = np.arange(T)[:, None] * 3.0 * inv
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def test_rope_rotates_only_its_dims_in_either_layout():
    rng = _rng(3)
    T, NH, D, off, R = 4, 3, 40, 24, 16
    x = _f32(rng, (T, NH, D))
    cos, sin = _tables(T, R // 2)
    c, s = cos[:, None].astype(np.float64), sin[:, None].astype(np.float64)
    part = x[..., off:off + R].astype(np.float64)
    y = x.copy()
    kern.rope(y, cos, sin, off)
    a, b = part[..., :R // 2], part[..., R // 2:]
    np.testing.assert_allclose(y[..., off:off + R], np.concatenate([a * c - b * s, b * c + a * s], -1),
                               atol=2e-6)
    assert np.array_equal(y[..., :off], x[..., :off]) and np.array_equal(y[..., off + R:], x[..., off + R:])
    z = x.copy()
    kern.rope(z, cos, sin, off, True)                  # DeepSeek: pairs (2i, 2i+1)
    e, o = part[..., 0::2], part[..., 1::2]
    np.testing.assert_allclose(z[..., off:off + R], np.concatenate([e * c - o * s, o * c + e * s], -1),
                               atol=2e-6)
    with pytest.raises(ValueError, match="rope"):
        kern.rope(x.copy(), cos, sin, 30)                # 30 + 16 > 40


# ------------------------------------------------------------- attention sinks


@threads
def test_attention_sinks_join_the_denominator(n_threads):
    rng = _rng(4)
    T, NH, NKV, D, S, pos0, window = 3, 4, 2, 16, 12, 5, 4
    q = _f32(rng, (T, NH, D))
    k = _f32(rng, (NKV, S, D))
    v = _f32(rng, (NKV, S, D))
    sinks = _f32(rng, (NH,), 2.0)
    out = np.zeros_like(q)
    kern.attention(q, k, v, pos0, window, 0.25, out, n_threads, sinks)
    for t in range(T):
        p = pos0 + t
        lo = max(0, p - window + 1)
        for h in range(NH):
            kh = h // 2
            sc = k[kh, lo:p + 1].astype(np.float64) @ q[t, h] * 0.25
            z = np.concatenate([sc, [sinks[h]]])
            w = np.exp(z - z.max())
            w = w[:-1] / w.sum()                        # the sink's column is dropped
            np.testing.assert_allclose(out[t, h], w @ v[kh, lo:p + 1], atol=2e-6)
    plain = np.zeros_like(q)
    kern.attention(q, k, v, pos0, window, 0.25, plain, n_threads)
    assert np.abs(plain - out).max() > 1e-3
    with pytest.raises(ValueError, match="sinks"):
        kern.attention(q, k, v, pos0, window, 0.25, out, 1,
                       np.zeros(3, np.float32))


# ------------------------------------------------------------- MLA: latent attention, per-head products


@threads
def test_latent_attention_equals_expanded_attention(n_threads):
    """Folding kv_b_proj into the query and the output gives what expanding every key and
    value gives (transformers' DeepseekV3Attention)."""
    rng = _rng(5)
    T, NH, r, dr, dn, dv, S, pos0 = 3, 4, 24, 8, 16, 12, 10, 6
    kv_b = (_f32(rng, (NH * (dn + dv), r)) * 0.3).astype(ml_dtypes.bfloat16)
    latents = _f32(rng, (S, r))
    k_rot = _f32(rng, (S, dr))
    q_nope = _f32(rng, (T, NH, dn))
    q_rot = _f32(rng, (T, NH, dr))
    scale = 0.2
    w = kv_b.astype(np.float64).reshape(NH, dn + dv, r)
    q_lat = np.zeros((T, NH, r), np.float32)
    kern.matmul_heads(kv_b, 0, dn, q_nope, q_lat, True, n_threads)
    np.testing.assert_allclose(q_lat, np.einsum("hnr,thn->thr", w[:, :dn], q_nope), atol=1e-5)
    cache = np.concatenate([latents, k_rot], axis=1)
    q = np.concatenate([q_lat, q_rot], axis=2)
    u = np.zeros((T, NH, r), np.float32)
    kern.latent_attention(q, cache, pos0, scale, u, n_threads)
    out = np.zeros((T, NH, dv), np.float32)
    kern.matmul_heads(kv_b, dn, dv, u, out, False, n_threads)
    keys = np.einsum("hnr,sr->hsn", w[:, :dn], latents)      # expanded: per head and position
    values = np.einsum("hvr,sr->hsv", w[:, dn:], latents)
    for t in range(T):
        n = pos0 + t + 1
        for h in range(NH):
            sc = (keys[h, :n] @ q_nope[t, h] + k_rot[:n] @ q_rot[t, h]) * scale
            p = np.exp(sc - sc.max())
            np.testing.assert_allclose(out[t, h], (p / p.sum()) @ values[h, :n], atol=2e-5)


def test_matmul_heads_takes_an_fp8_weight_with_partial_blocks():
    """kv_b_proj in FP8 (DeepSeek-V3's published format): the per-head products read it
    through its block scales, rows of a head crossing block boundaries."""
    rng = _rng(6)
    NH, dn, dv, r = 3, 40, 24, 72                           # 3 x 64 rows: blocks of 128 cut heads
    codes, scales = random_fp8(rng, NH * (dn + dv), r)
    q = kern.QuantizedWeight("fp8_e4m3", codes, scales)
    dense = dequantize_fp8(codes, scales).astype(np.float64).reshape(NH, dn + dv, r)
    x = _f32(rng, (2, NH, dn))
    out = np.zeros((2, NH, r), np.float32)
    kern.matmul_heads(q, 0, dn, x, out, True, 2)
    np.testing.assert_allclose(out, np.einsum("hnr,thn->thr", dense[:, :dn], x), rtol=1e-5, atol=1e-4)
    y = _f32(rng, (2, NH, r))
    out2 = np.zeros((2, NH, dv), np.float32)
    kern.matmul_heads(q, dn, dv, y, out2, False, 2)
    np.testing.assert_allclose(out2, np.einsum("hvr,thr->thv", dense[:, dn:], y), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("transpose", [False, True])
def test_matmul_heads_is_the_same_whatever_threads_and_tokens(transpose):
    rng = _rng(7, transpose)
    NH, G, C, rows = 8, 64, 256, 48
    w = (_f32(rng, (NH * G, C)) * 0.1).astype(ml_dtypes.bfloat16)
    x = _f32(rng, (5, NH, rows if transpose else C))
    outs = []
    for nt in THREADS:
        out = np.zeros((5, NH, C if transpose else rows), np.float32)
        kern.matmul_heads(w, 8, rows, x, out, transpose, nt)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
    one = np.zeros((1, NH, C if transpose else rows), np.float32)
    kern.matmul_heads(w, 8, rows, x[2:3].copy(), one, transpose, 2)
    assert np.array_equal(one[0], outs[0][2])
    with pytest.raises(ValueError, match="outside a head"):
        kern.matmul_heads(w, 40, rows, x, outs[0], transpose, 1)


@pytest.mark.parametrize("n_threads", THREADS)
def test_matmul_heads_fast_is_matmul_fast_of_each_head_block(n_threads):
    """fast=True (MXFP4 kv_b-like weight): out[t, h] is bit-equal to matmul(..., fast=True)
    of head h's row block on x[t, h]; transposed products stay exact (fast is ignored)."""
    rng = _rng(8, n_threads)
    NH, G, C, row0, rows = 3, 40, 544, 8, 21     # 17 blocks: a whole chunk and one more
    w = kern.QuantizedWeight("mxfp4", *random_mxfp4(rng, NH * G, C))
    x = _f32(rng, (3, NH, C))
    out = np.zeros((3, NH, rows), np.float32)
    kern.matmul_heads(w, row0, rows, x, out, False, n_threads, fast=True)
    for h in range(NH):
        block = kern.QuantizedWeight("mxfp4", w.codes[h * G + row0:h * G + row0 + rows],
                                     w.scales[h * G + row0:h * G + row0 + rows])
        want = np.zeros((3, rows), np.float32)
        kern.matmul(block, x[:, h].copy(), want, 1, fast=True)
        assert np.array_equal(out[:, h].view(np.uint32), want.view(np.uint32)), h
    exact = np.zeros((3, NH, rows), np.float32)
    kern.matmul_heads(w, row0, rows, x, exact, False, n_threads)
    assert not np.array_equal(exact, out)
    y = _f32(rng, (3, NH, rows))
    t_fast, t_exact = (np.zeros((3, NH, C), np.float32) for _ in range(2))
    kern.matmul_heads(w, row0, rows, y, t_fast, True, n_threads, fast=True)
    kern.matmul_heads(w, row0, rows, y, t_exact, True, n_threads)
    assert np.array_equal(t_fast.view(np.uint32), t_exact.view(np.uint32))


# ------------------------------------------------------------- GPT-OSS's fused experts


def gpt_oss_reference(gate_up, down, b1, b2, x, alpha=1.702, limit=7.0):
    """transformers' GptOssExperts for one expert, float64; gate_up [2I, H] rows = outputs."""
    z = x.astype(np.float64) @ gate_up.T + b1
    gate, up = z[:, ::2], z[:, 1::2]
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
    return ((up + 1) * gate / (1 + np.exp(-alpha * gate))) @ down.T + b2


def _fused(gate_ups, downs, b1, b2, x, group_start, transposed, n_threads, I):
    out = np.full((x.shape[0], x.shape[1]), np.nan, np.float32)
    kern.expert_ffn_fused(gate_ups, downs, b1, b2, x, group_start, np.zeros((x.shape[0], I), np.float32),
                          out, transposed, 1.702, 7.0, n_threads)
    return out


@pytest.mark.parametrize("fmt", ["bf16-transposed", "f32-transposed", "mxfp4"])
def test_fused_experts_match_gpt_oss(fmt):
    rng = _rng(8, ["bf16-transposed", "f32-transposed", "mxfp4"].index(fmt))
    H, I, K = 96, 64, 3
    group_start = np.array([0, 2, 2, 5], np.int64)          # the middle expert has no tokens
    x = _f32(rng, (5, H))
    b1, b2 = _f32(rng, (K, 2 * I)), _f32(rng, (K, H))
    if fmt == "mxfp4":
        gu = [random_mxfp4(rng, 2 * I, H) for _ in range(K)]
        dn = [random_mxfp4(rng, H, I) for _ in range(K)]
        gate_ups = [kern.QuantizedWeight("mxfp4", *p) for p in gu]
        downs = [kern.QuantizedWeight("mxfp4", *p) for p in dn]
        dense_gu = [dequantize_mxfp4(*p) for p in gu]
        dense_dn = [dequantize_mxfp4(*p) for p in dn]
        transposed = False
    else:
        dtype = ml_dtypes.bfloat16 if fmt.startswith("bf16") else np.float32
        dense_gu = [(_f32(rng, (2 * I, H)) * 0.2).astype(dtype).astype(np.float32) for _ in range(K)]
        dense_dn = [(_f32(rng, (H, I)) * 0.2).astype(dtype).astype(np.float32) for _ in range(K)]
        gate_ups = [np.ascontiguousarray(g.T.astype(dtype)) for g in dense_gu]    # [H, 2I]
        downs = [np.ascontiguousarray(d.T.astype(dtype)) for d in dense_dn]       # [I, H]
        transposed = True
    got = [_fused(gate_ups, downs, b1, b2, x, group_start, transposed, nt, I) for nt in THREADS]
    assert np.array_equal(got[0], got[1])
    for k in range(K):
        rows = slice(group_start[k], group_start[k + 1])
        if rows.start == rows.stop:
            continue
        want = gpt_oss_reference(dense_gu[k].astype(np.float64), dense_dn[k].astype(np.float64),
                                 b1[k], b2[k], x[rows])
        np.testing.assert_allclose(got[0][rows], want, rtol=1e-4, atol=2e-4 * np.abs(want).max())
    # A token alone gives the bits it gets among others (rows are computed alone).
    alone = _fused([gate_ups[2]], [downs[2]], b1[2:], b2[2:], x[3:4].copy(),
                   np.array([0, 1], np.int64), transposed, 2, I)
    assert np.array_equal(alone[0], got[0][3])


def test_gate_and_up_interleave_and_nibble_order_matter():
    """Read the gate_up rows as two halves instead of interleaved, or an MXFP4 byte's
    nibbles the other way round, and the answer changes: the kernel reads GPT-OSS's."""
    rng = _rng(9)
    H, I = 64, 32
    blocks, scales = random_mxfp4(rng, 2 * I, H)
    down_b, down_s = random_mxfp4(rng, H, I)
    x = _f32(rng, (2, H))
    b1, b2 = np.zeros((1, 2 * I), np.float32), np.zeros((1, H), np.float32)
    got = _fused([kern.QuantizedWeight("mxfp4", blocks, scales)],
                 [kern.QuantizedWeight("mxfp4", down_b, down_s)], b1, b2, x,
                 np.array([0, 2], np.int64), False, 1, I)
    gu, dn = dequantize_mxfp4(blocks, scales).astype(np.float64), dequantize_mxfp4(down_b, down_s)
    right = gpt_oss_reference(gu, dn.astype(np.float64), 0.0, 0.0, x)
    np.testing.assert_allclose(got, right, rtol=1e-4, atol=1e-4 * np.abs(right).max())
    halves = np.empty_like(gu)
    halves[0::2], halves[1::2] = gu[:I], gu[I:]              # gate = first half, up = second
    assert np.abs(gpt_oss_reference(halves, dn, 0.0, 0.0, x) - got).max() > 0.1 * np.abs(right).max()
    swapped = ((blocks & 0x0F) << 4 | blocks >> 4).astype(np.uint8)
    wrong = gpt_oss_reference(dequantize_mxfp4(swapped, scales).astype(np.float64), dn, 0.0, 0.0, x)
    assert np.abs(wrong - got).max() > 0.1 * np.abs(right).max()


def test_fused_experts_refuse_bad_input():
    H, I = 32, 16
    gu = np.zeros((H, 2 * I), ml_dtypes.bfloat16)
    dn = np.zeros((I, H), ml_dtypes.bfloat16)
    x = np.zeros((1, H), np.float32)
    gs = np.array([0, 1], np.int64)
    b1, b2 = np.zeros((1, 2 * I), np.float32), np.zeros((1, H), np.float32)
    hb, out = np.zeros((1, I), np.float32), np.zeros((1, H), np.float32)
    with pytest.raises(ValueError, match="biases"):
        kern.expert_ffn_fused([gu], [dn], b1[:, :3].copy(), b2, x, gs, hb, out, True, 1.7, 7.0)
    with pytest.raises(ValueError, match=r"downs\[0\]: shape"):
        kern.expert_ffn_fused([gu], [np.zeros((H, I), ml_dtypes.bfloat16)], b1, b2, x, gs, hb, out,
                              True, 1.7, 7.0)
    blocks, scales = random_mxfp4(np.random.default_rng(0), 2 * I, H)
    with pytest.raises(ValueError, match="plain"):
        kern.expert_ffn_fused([kern.QuantizedWeight("mxfp4", blocks, scales)], [dn], b1, b2, x, gs,
                              hb, out, True, 1.7, 7.0)
