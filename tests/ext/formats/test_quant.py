"""ext/formats/quant.py: the quantization config, telling formats apart, piece validation.

Tensor tables are built by hand (TensorInfo), so that each layout and each defect can be
produced on its own; tests/ext/formats/test_quant_bad_files.py damages real checkpoints.
"""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from ext.formats.checkpoint import Checkpoint, MissingTensorError, TensorInfo, UnsupportedDtypeError
from ext.formats.quant import (ATTENTION, EXPERT, HEAD, MXFP4, ROUTER, BadScaleError,
                               FormatMismatchError, MissingPieceError, Mxfp4Layout, PieceShapeError,
                               QuantizationConfigError, StoredWeight, formats,
                               parse_quantization_config, quantization_label, resolve_weight)

CONFIG = "/m/config.json"
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
       "activation_scheme": "dynamic"}


def quant(**fields):
    return parse_quantization_config({"quantization_config": {**FP8, **fields}}, CONFIG)


def info(name, dtype, shape, path="/m/a.safetensors", offset=0):
    size = {"F32": 4, "BF16": 2, "F16": 2}.get(dtype, 1)
    return TensorInfo(name=name, path=path, offset=offset, nbytes=int(np.prod(shape)) * size,
                      dtype=dtype, shape=tuple(shape))


def table(*infos):
    return {i.name: i for i in infos}


M = "model.layers.0.self_attn.q_proj"


def fp8_table(shape=(576, 7168), grid=(5, 56), scale_dtype="F32"):
    return table(info(f"{M}.weight", "F8_E4M3", shape), info(f"{M}.weight_scale_inv", scale_dtype, grid))


# ------------------------------------------------------------------------ the config


def test_no_quantization_config_is_none():
    assert parse_quantization_config({"model_type": "qwen3_moe"}, CONFIG) is None
    assert quantization_label(None) == "none"


def test_deepseek_v3_config_is_read():
    q = quant()
    assert (q.fmt, q.weight_block_size, q.activation_scheme, q.scale_fmt) == ("e4m3", (128, 128),
                                                                               "dynamic", "float")
    assert q.describe() == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                            "activation_scheme": "dynamic", "scale_fmt": "float"}
    assert quantization_label(q) == "fp8_e4m3"
    assert quant(scale_fmt="ue8m0").scale_dtypes() == ("F32", "BF16", "U8", "F8_E8M0")
    # defaults as transformers' FineGrainedFP8Config: no fmt, no block size, no scheme
    bare = parse_quantization_config({"quantization_config": {"quant_method": "fp8"}}, CONFIG)
    assert (bare.fmt, bare.weight_block_size, bare.activation_scheme) == ("e4m3", (128, 128), "dynamic")


@pytest.mark.parametrize("fields, field, what", [
    ({"quant_method": "gptq"}, "quantization_config.quant_method", "'gptq' is not supported"),
    ({"quant_method": None}, "quantization_config.quant_method", "None is not supported"),
    ({"fmt": "e5m2"}, "quantization_config.fmt", "'e5m2' is not supported"),
    ({"activation_scheme": "static"}, "quantization_config.activation_scheme", "'static'"),
    ({"scale_fmt": "e4m3"}, "quantization_config.scale_fmt", "'e4m3' is not supported"),
    ({"weight_block_size": [128]}, "quantization_config.weight_block_size", "positive ints"),
    ({"weight_block_size": [0, 128]}, "quantization_config.weight_block_size", "positive ints"),
    ({"weight_block_size": None}, "quantization_config.weight_block_size", "per-tensor"),
    ({"modules_to_not_convert": "lm_head"}, "quantization_config.modules_to_not_convert", "a list"),
    ({"modules_to_not_convert": ["(unclosed"]}, "quantization_config.modules_to_not_convert",
     "not a regular expression"),
    ({"modules_to_convert": ["model.embed_tokens"]}, "quantization_config.modules_to_convert",
     "not supported"),
    ({"expert_dtype": "fp4"}, "quantization_config.expert_dtype", "'fp4'"),
])
def test_unknown_method_fmt_or_scheme_names_the_field(fields, field, what):
    with pytest.raises(QuantizationConfigError) as e:
        quant(**fields)
    assert e.value.field == field
    assert str(e.value).startswith(f"{CONFIG}: field '{field}': ") and what in str(e.value)


def test_quantization_config_that_is_not_an_object():
    with pytest.raises(QuantizationConfigError, match="expected an object"):
        parse_quantization_config({"quantization_config": ["fp8"]}, CONFIG)


def test_modules_to_not_convert_match_as_transformers_does():
    q = quant(modules_to_not_convert=["model.layers.1", "lm_head", "model.layers.*.mlp.gate",
                                      "shared_expert_gate"])
    assert not q.converts("model.layers.1.self_attn.q_proj")           # prefix up to a boundary
    assert q.converts("model.layers.11.self_attn.q_proj")
    assert not q.converts("lm_head")
    assert not q.converts("model.layers.7.mlp.gate")                   # regular expression
    assert q.converts("model.layers.7.mlp.gate_proj")
    assert not q.converts("model.layers.3.mlp.shared_expert_gate")     # suffix
    # MiniMax writes the list as ignored_layers
    assert not quant(ignored_layers=["lm_head"]).converts("lm_head")


# ------------------------------------------------------------------------ telling formats apart


def test_fp8_weight_with_partial_blocks_as_deepseek_kv_a_proj():
    w = resolve_weight(fp8_table(), M, (576, 7168), ATTENTION, quant(), "/m")
    assert (w.format, w.shape, w.block, w.scale_dtype) == ("fp8_e4m3", (576, 7168), (128, 128), "F32")
    assert [p.name for p in w.pieces] == [f"{M}.weight", f"{M}.weight_scale_inv"]
    assert w.nbytes == 576 * 7168 + 5 * 56 * 4
    assert w.piece("scale").shape == (5, 56)


def test_plain_weight_and_fp8_scales_of_other_block_sizes():
    plain = resolve_weight(table(info(f"{M}.weight", "BF16", (8, 4))), M, (8, 4), ATTENTION, None, "/m")
    assert plain == StoredWeight.plain(info(f"{M}.weight", "BF16", (8, 4))) and plain.format == "bf16"
    w = resolve_weight(fp8_table((100, 70), (4, 3), "BF16"), M, (100, 70), ATTENTION,
                       quant(weight_block_size=[32, 32]), "/m")
    assert (w.block, w.scale_dtype) == ((32, 32), "BF16")


def test_e8m0_scales_need_scale_fmt_ue8m0():
    t = fp8_table(scale_dtype="U8")
    assert resolve_weight(t, M, (576, 7168), ATTENTION, quant(scale_fmt="ue8m0"), "/m").scale_dtype == "U8"
    with pytest.raises(PieceShapeError, match="dtype U8.*scale_fmt 'ue8m0'") as e:
        resolve_weight(t, M, (576, 7168), ATTENTION, quant(), "/m")
    assert e.value.tensor == f"{M}.weight_scale_inv" and e.value.path == "/m/a.safetensors"


def test_missing_scale_names_the_tensor_and_the_weights_file():
    t = table(info(f"{M}.weight", "F8_E4M3", (576, 7168), path="/m/shard-3.safetensors"))
    with pytest.raises(MissingPieceError) as e:
        resolve_weight(t, M, (576, 7168), ATTENTION, quant(), "/m")
    assert e.value.tensor == f"{M}.weight_scale_inv" and e.value.path == "/m/shard-3.safetensors"
    assert isinstance(e.value, MissingTensorError)


@pytest.mark.parametrize("grid", [(4, 56), (5, 57), (56, 5), (5,)])
def test_scale_grid_of_the_wrong_shape(grid):
    with pytest.raises(PieceShapeError, match=r"needs \[5, 56\]") as e:
        resolve_weight(fp8_table(grid=grid), M, (576, 7168), ATTENTION, quant(), "/m")
    assert e.value.tensor == f"{M}.weight_scale_inv"


def test_fp8_weight_of_the_wrong_shape():
    with pytest.raises(PieceShapeError, match="config implies"):
        resolve_weight(fp8_table(), M, (576, 7000), ATTENTION, quant(), "/m")


def test_config_says_fp8_but_the_tensor_is_bf16():
    t = table(info(f"{M}.weight", "BF16", (8, 4)))
    with pytest.raises(FormatMismatchError, match="dtype BF16.*quant_method 'fp8'") as e:
        resolve_weight(t, M, (8, 4), ATTENTION, quant(), "/m")
    assert e.value.tensor == f"{M}.weight"
    # ... unless modules_to_not_convert lists it; routers and lm_head may be either
    assert resolve_weight(t, M, (8, 4), ATTENTION, quant(modules_to_not_convert=[M]), "/m").format == "bf16"
    assert resolve_weight(t, M, (8, 4), ROUTER, quant(), "/m").format == "bf16"
    assert resolve_weight(t, M, (8, 4), HEAD, quant(), "/m").format == "bf16"


def test_fp8_tensors_without_a_quantization_config():
    with pytest.raises(FormatMismatchError, match="stored as fp8_e4m3, but config.json has no "
                                                  "quantization_config") as e:
        resolve_weight(fp8_table(), M, (576, 7168), ATTENTION, None, "/m")
    assert e.value.tensor == f"{M}.weight"


def test_fp8_tensors_of_a_module_the_config_keeps():
    with pytest.raises(FormatMismatchError, match="modules_to_not_convert lists this module"):
        resolve_weight(fp8_table(), M, (576, 7168), ATTENTION, quant(modules_to_not_convert=[M]), "/m")


def test_fp8_tensors_under_an_mxfp4_config():
    mx = parse_quantization_config({"quantization_config": {"quant_method": "mxfp4"}}, CONFIG)
    with pytest.raises(FormatMismatchError, match="quant_method 'mxfp4' stores mxfp4"):
        resolve_weight(fp8_table(), M, (576, 7168), ATTENTION, mx, "/m")


def test_a_scale_beside_a_bf16_weight_is_two_formats_at_once():
    t = table(info(f"{M}.weight", "BF16", (8, 4)), info(f"{M}.weight_scale_inv", "F32", (1, 1)))
    with pytest.raises(FormatMismatchError, match="stored as bf16 .* and as fp8_e4m3"):
        resolve_weight(t, M, (8, 4), ATTENTION, quant(modules_to_not_convert=[M]), "/m")


def test_a_weight_dtype_no_format_reads_and_a_missing_weight():
    with pytest.raises(UnsupportedDtypeError, match="F8_E5M2 is not a weight format"):
        resolve_weight(table(info(f"{M}.weight", "F8_E5M2", (8, 4))), M, (8, 4), ATTENTION, quant(), "/m")
    with pytest.raises(MissingTensorError) as e:
        resolve_weight({}, M, (8, 4), ATTENTION, None, "/m")
    assert e.value.tensor == f"{M}.weight" and e.value.path == "/m"


E = "model.layers.2.mlp.experts.7.down_proj"
MX = parse_quantization_config({"quantization_config": {"quant_method": "mxfp4"}}, CONFIG)


def mx_table(blocks=(64, 4, 16), scales=(64, 4), bdtype="U8", sdtype="U8"):
    return table(info(f"{E}.weight_blocks", bdtype, blocks), info(f"{E}.weight_scales", sdtype, scales))


def test_mxfp4_expert():
    w = resolve_weight(mx_table(), E, (64, 128), EXPERT, MX, "/m")
    assert (w.format, w.shape, w.block) == (MXFP4, (64, 128), (1, 32))
    assert w.nbytes == 64 * 4 * 16 + 64 * 4
    assert list(w.checked_pieces()) == ["scales"]


@pytest.mark.parametrize("blocks, scales, bdtype, sdtype, what", [
    ((64, 4, 16), (64, 2), "U8", "U8", r"shape \[64, 2\].*needs \[64, 4\]"),
    ((64, 4, 16), (32, 4), "U8", "U8", r"shape \[32, 4\]"),
    ((64, 2, 32), (64, 4), "U8", "U8", r"needs \[64, 4, 16\]"),
    ((64, 4, 16), (64, 4), "U8", "BF16", "dtype BF16"),
    ((64, 4, 16), (64, 4), "I8", "U8", "dtype I8"),
])
def test_blocks_and_scales_that_disagree(blocks, scales, bdtype, sdtype, what):
    with pytest.raises(PieceShapeError, match=what):
        resolve_weight(mx_table(blocks, scales, bdtype, sdtype), E, (64, 128), EXPERT, MX, "/m")


def test_blocks_without_scales_and_the_reverse():
    t = mx_table()
    for present, missing in (("weight_blocks", "weight_scales"), ("weight_scales", "weight_blocks")):
        with pytest.raises(MissingPieceError) as e:
            resolve_weight({f"{E}.{present}": t[f"{E}.{present}"]}, E, (64, 128), EXPERT, MX, "/m")
        assert e.value.tensor == f"{E}.{missing}" and e.value.path == "/m/a.safetensors"


def test_mxfp4_needs_inputs_in_groups_of_32():
    with pytest.raises(PieceShapeError, match="not a multiple of 32"):
        resolve_weight(mx_table((64, 3, 16), (64, 3)), E, (64, 80), EXPERT, MX, "/m")


def test_config_says_mxfp4_but_the_experts_are_bf16_and_the_reverse():
    t = table(info(f"{E}.weight", "BF16", (64, 128)))
    with pytest.raises(FormatMismatchError, match="quant_method 'mxfp4'"):
        resolve_weight(t, E, (64, 128), EXPERT, MX, "/m")
    dense = table(info(f"{M}.weight", "BF16", (64, 128)))
    assert resolve_weight(dense, M, (64, 128), ATTENTION, MX, "/m").format == "bf16"  # as stored
    with pytest.raises(FormatMismatchError, match="no quantization_config"):
        resolve_weight(mx_table(), E, (64, 128), EXPERT, None, "/m")


def test_fused_gpt_oss_tensors_give_each_expert_a_byte_range(tmp_path):
    """GPT-OSS stores every expert of a layer in one [E, R, G, 16] tensor: an expert's
    pieces are byte ranges of it (TensorInfo.index), read like whole tensors."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (4, 6, 2, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (4, 6, 2), dtype=np.uint8)
    p = "model.layers.0.mlp.experts.gate_up_proj"
    save_file({f"{p}_blocks": blocks, f"{p}_scales": scales}, str(tmp_path / "model.safetensors"))
    with Checkpoint(tmp_path) as ckpt:
        w = Mxfp4Layout().fused_expert(ckpt.tensors, p, 2, (6, 64), str(tmp_path))
        assert [i.name for i in w.pieces] == [f"{p}_blocks[2]", f"{p}_scales[2]"]
        assert w.pieces[0].offset == ckpt.info(f"{p}_blocks").offset + 2 * 6 * 2 * 16
        assert np.array_equal(ckpt.read(w.pieces[0]), blocks[2])
        assert np.array_equal(ckpt.read(w.pieces[1]), scales[2])
        with pytest.raises(PieceShapeError, match="holds 4 experts"):
            Mxfp4Layout().fused_expert(ckpt.tensors, p, 4, (6, 64), str(tmp_path))
        with pytest.raises(IndexError):
            ckpt.info(f"{p}_scales").index(-1)


# ------------------------------------------------------------------------ values


def test_nan_inf_and_negative_scales_are_refused_naming_the_tensor():
    w = resolve_weight(fp8_table((256, 256), (2, 2)), M, (256, 256), ATTENTION, quant(), "/m")
    w.check_values({"scale": np.ones((2, 2), np.float32)})
    w.check_values({"scale": np.zeros((2, 2), np.float32)})       # a block of zeros is a value
    for bad, what in ((np.nan, "nan"), (np.inf, "inf"), (-0.5, "-0.5")):
        scales = np.ones((2, 2), np.float32)
        scales[1, 0] = bad
        with pytest.raises(BadScaleError, match=rf"1 of 4 scales.*{what}.*at \[1, 0\]") as e:
            w.check_values({"scale": scales})
        assert e.value.tensor == f"{M}.weight_scale_inv" and e.value.path == "/m/a.safetensors"


def test_e8m0_255_is_refused():
    w = resolve_weight(mx_table(), E, (64, 128), EXPERT, MX, "/m")
    scales = np.full((64, 4), 127, np.uint8)
    w.check_values({"scales": scales})
    scales[3, 2] = 255
    with pytest.raises(BadScaleError, match=r"255 \(NaN\).*\[3, 2\]") as e:
        w.check_values({"scales": scales})
    assert e.value.tensor == f"{E}.weight_scales"


def test_formats_is_a_closed_set():
    assert set(formats()) >= {"f32", "f16", "bf16", "fp8_e4m3", "mxfp4"}
