"""Low-bit checkpoints read independently of moed, for the oracle tests.

The element formats are decoded by tests/quant_reference.py (numpy, written from the OCP
FP8 and MX specs, not from moed's kernels); this module reads a whole checkpoint with
the safetensors library and applies them by the checkpoint's own description — never
ext/formats, and never transformers' FP8 dequantiser (which infers the block size from
the scale grid and is wrong for shapes that are not multiples of 128):

  FP8: `<module>.weight` F8_E4M3 [R, C] x `<module>.weight_scale_inv` per block of
      quantization_config.weight_block_size (the last block partial); scales F32, BF16,
      or UE8M0 exponents (U8 / F8_E8M0).
  MXFP4: `<module>.weight_blocks` U8 [R, C/32, 16] with `<module>.weight_scales` U8;
      GPT-OSS's experts fused over [E, ...], `<param>_blocks` U8 [E, R, C/32, 16] with
      `<param>_scales` [E, R, C/32] (rows = outputs), which transformers keeps as plain
      `<param>` [E, C, R] (inputs first): the twin stores them so.
  moed's int4 / int8 repack (quant_method "moed"): `<module>.weight` U8 [R, C/2] (int4) or
      I8 [R, C] (int8) with `<module>.weight_scale` F16 [R, C/g] and, for int4 with a
      minimum, `<module>.weight_min`; shards also hold `moed.padding.*` U8 tensors, which
      are not weights.

`dequantised_twin` writes a plain float32 copy of a low-bit checkpoint (same tensor
names, `<module>.weight` for every quantised weight, no quantization_config) that
transformers loads with its own model classes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from quant_reference import dequantize_fp8, dequantize_int4, dequantize_int8, dequantize_mxfp4
from safetensors.torch import load_file, save_file


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """Codes and E8M0 scales as uint8, bf16 as ml_dtypes.bfloat16, the rest as float32."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8):
        return t.view(torch.uint8).numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.float().numpy()


def read_tensors(model_dir: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (torch dtype name, numpy array: codes as uint8, bf16 as bf16, else float32)."""
    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, t in load_file(path).items():
            out[name] = (str(t.dtype).removeprefix("torch."), _as_numpy(t))
    return out


def dequantise(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint as float32, quantised weights dequantised (by the
    config's quantization_config, never by guessing from the shapes)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    block = tuple(quant.get("weight_block_size", (128, 128)))
    tensors = read_tensors(model_dir)
    out = {}
    for name, (dtype, array) in tensors.items():
        if name.endswith(("_scale_inv", "_scales", ".weight_scale", ".weight_min")):
            continue
        if name.startswith("moed.padding."):
            assert method == "moed" and not array.any()
            continue
        if method == "moed" and name + "_scale" in tensors:
            scale = tensors[name + "_scale"][1]
            if dtype == "int8":
                out[name] = dequantize_int8(tensors[name][1].astype(np.int8), scale)
            else:
                assert dtype == "uint8"
                minimum = tensors[name + "_min"][1] if name + "_min" in tensors else None
                out[name] = dequantize_int4(array, scale, minimum)
            continue
        if name.endswith(".weight_blocks"):
            assert method == "mxfp4"
            base = name.removesuffix("_blocks")
            out[base] = dequantize_mxfp4(array, tensors[base + "_scales"][1])
        elif name.endswith("_blocks"):                     # GPT-OSS: fused over experts
            assert method == "mxfp4"
            base = name.removesuffix("_blocks")
            E, R, G, _ = array.shape
            values = dequantize_mxfp4(array.reshape(E * R, G, 16),
                                      tensors[base + "_scales"][1].reshape(E * R, G))
            out[base] = np.ascontiguousarray(values.reshape(E, R, 32 * G).transpose(0, 2, 1))
        elif dtype == "float8_e4m3fn":
            assert method == "fp8"
            out[name] = dequantize_fp8(array, tensors[name + "_scale_inv"][1], block)
        else:
            out[name] = array.astype(np.float32)
    return out


def dequantised_twin(model_dir: Path, twin_dir: Path) -> Path:
    """Write the float32 dequantised copy of `model_dir` (config without its
    quantization_config) into `twin_dir`; returns twin_dir."""
    twin_dir.mkdir(parents=True)
    save_file({k: torch.from_numpy(v) for k, v in dequantise(model_dir).items()},
              str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = config["torch_dtype"] = "float32"
    (twin_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, twin_dir / name)
    return twin_dir


# ------------------------------------------------------------- the oracle of a low-bit case


def select_lowbit_seed(make, case_id: str, root: Path):
    """The Reference (tests/oracle_models.py) of the first seed in 0..MAX_SEEDS-1 whose
    reference run — transformers on the dequantised twin of `make(root / f"seed{s}", s)`,
    a low-bit checkpoint — has clear margins; fails the test after MAX_SEEDS rejections."""
    import logging

    import pytest
    from oracle_models import (MAX_SEEDS, Reference, SeedRejected, check_margins,
                               load_reference_model, make_prompt, reference_run)

    log = logging.getLogger(__name__)
    last = ""
    for seed in range(MAX_SEEDS):
        model_dir = make(root / f"seed{seed}", seed)
        twin = dequantised_twin(model_dir, root / f"seed{seed}-twin")
        model = load_reference_model(twin)
        prompt = make_prompt(model.config.vocab_size, seed)
        tokens, steps, teacher, routers, _ = reference_run(model, prompt)
        try:
            check_margins(steps, routers, model.config.num_experts_per_tok)
        except SeedRejected as e:
            last = str(e)
            log.warning("%s: seed %d rejected (%s)", case_id, seed, last)
            continue
        log.info("%s: using seed %d", case_id, seed)
        return Reference(model_dir, seed, prompt, tokens, steps, teacher, routers, None)
    pytest.fail(f"low-bit oracle case {case_id}: no seed in 0..{MAX_SEEDS - 1} gives clear "
                f"margins (last: {last})")


def moed_run(model_dir: Path, prompt: list[int], tokens: list[int], **kw):
    """moed's greedy tokens and step logits from `prompt`, its teacher-forced logits over
    prompt + tokens, and its weight_formats(), with open_model's options `kw`."""
    from oracle_models import moed_greedy, open_model

    with open_model(model_dir, **kw) as model:
        got_tokens, steps = moed_greedy(model, prompt)
        teacher = model.forward(model.new_sequence(), prompt + tokens, all_logits=True)
        formats = model.weight_formats()
    return got_tokens, steps, teacher, formats


class LowBitOracle:
    """The reference and moed's run of each low-bit oracle case, built once per session.

    A case has `id` and `make(root, seed) -> model dir`. `reference(case)`: the first seed
    with clear margins (`select_lowbit_seed`); `moed(case)`: `moed_run` of that checkpoint.
    """

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._refs: dict = {}
        self._runs: dict = {}

    def reference(self, case):
        if case.id not in self._refs:
            self._refs[case.id] = select_lowbit_seed(case.make, case.id, self._tmp.mktemp(case.id))
        return self._refs[case.id]

    def moed(self, case):
        if case.id not in self._runs:
            ref = self.reference(case)
            self._runs[case.id] = moed_run(ref.model_dir, ref.prompt, ref.tokens)
        return self._runs[case.id]


def assert_placement_invisible(ref, base, **kw) -> None:
    """moed_run with open_model's options `kw` gives `base`'s tokens and logits bit for bit
    (and the reference's tokens)."""
    got = moed_run(ref.model_dir, ref.prompt, ref.tokens, **kw)
    assert got[0] == base[0] == ref.tokens
    assert np.array_equal(got[1], base[1]) and np.array_equal(got[2], base[2])
