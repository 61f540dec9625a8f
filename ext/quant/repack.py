"""Write a repacked model directory: routed experts (and optionally dense weights) in
moed's int4 / int8 group format, laid out for streaming (ext/formats/repacked.py).

`repack(model_dir, out_dir, spec)` reads a model directory moed can load, quantises
every routed expert's gate, up and down projections with `spec.experts` (and, with
`spec.dense`, the attention projections, shared experts and dense MLPs, and with
`spec.lm_head` lm_head too; routers, norms and embeddings are never quantised), copies
every other tensor byte for byte, and writes config.json with moed's quantization_config plus every other regular
file of the directory (tokenizer files, generation_config.json, chat template, licence)
unchanged. The output is built in a temporary directory beside `out_dir` and renamed
into place at the end, so a failed or interrupted repack leaves no half-written model.

`out_dir` (check_out_dir) may not be, contain or lie inside the model directory; an
existing one is replaced (with `overwrite`, i.e. --force) only when it is empty or a
previous repack's output (config.json with quant_method "moed"), never anything else.
The temporary directory is `.<out name>.moed-repack-<pid>.<random>`, holding the new
output, the replaced one while it is swapped out, and a `lock` file its writer holds
(fcntl.flock) until it is done. A repack killed before the end leaves it behind: the
next repack into the same parent removes every such directory whose lock is free (its
writer is gone, whatever became of its pid) and keeps those of repacks still running.

Shards hold whole blocks — one routed expert, or one dense tensor — in the order dense
tensors (by name), then experts by (layer, expert); a shard is closed when the next
block would pass `shard_size` bytes (a block larger than that gets a shard of its own).
Memory: one expert (or one dense tensor) at a time, in float32, plus its codes.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import struct
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ext.formats.checkpoint import CONFIG_NAME, FLOAT_DTYPES, INDEX_NAME, Checkpoint, TensorInfo
from ext.formats.files import read_json
from ext.formats.repacked import (ALIGNMENT, PADDING_PREFIX, QUANT_METHOD, TENSOR_ALIGNMENT, QuantGroup,
                                  QuantScheme, RepackConfig, min_name, read_repack_config, scale_name)
from ext.models.config import load_config
from ext.models.experts import ExpertLayout, expert_tensor_name
from ext.models.family import PROJECTIONS
from ext.models.weights import weight_values
from ext.quant.codec import (QuantizedTensor, importance_weights, magnitude_weights,
                             quantize, quantize_gptq)
from ext.quant.importance import PRIOR_TOKENS, ImportanceStats, LayerwiseMoments

DEFAULT_SHARD_SIZE = 2 << 30      # bytes of tensor data per shard
WEIGHTINGS = ("uniform", "magnitude", "importance", "importance*magnitude")
_DENSE_PATTERNS = (r"model\.layers\.\d+\.self_attn\.[qkvo]_proj\.weight",
                   r"model\.layers\.\d+\.mlp\.shared_expert\.(gate|up|down)_proj\.weight",
                   r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight")
_COPIED_SKIP = (CONFIG_NAME, INDEX_NAME)
TEMP_MARK = ".moed-repack-"          # in the name of a repack's temporary directory
TEMP_LOCK = "lock"                   # the file in it that its writer holds locked
_TEMP_NAME = re.compile(r"\..*\.moed-repack-(\d+)\.[a-z0-9_]+")


@dataclass(frozen=True)
class RepackSpec:
    """What `repack` does.

    experts: the routed experts' scheme. dense: a scheme for the attention projections,
    shared experts and dense MLPs, or None (they stay as stored). lm_head: quantise the
    output projection too, with `dense`'s scheme (as llama.cpp's k-quant mixes do; a
    model whose lm_head is tied to its embeddings has none to quantise). method: "search" or
    "rtn" (ext/quant/codec.py). weighting: the error weights of the search — "uniform",
    "magnitude" (k-quants' rms + |x|), "importance" (column importance from calibration
    text) or "importance*magnitude" (llama.cpp's imatrix weighting); the importance ones
    need `ImportanceStats` and apply to routed experts (dense weights then use magnitude).
    prior_tokens: the layer prior's pseudo-count in an expert's importance.
    """

    experts: QuantScheme
    dense: QuantScheme | None = None
    lm_head: bool = False
    method: str = "search"
    weighting: str = "magnitude"
    prior_tokens: float = PRIOR_TOKENS

    def __post_init__(self):
        if self.method not in ("rtn", "search", "gptq"):
            raise ValueError(f"unknown method {self.method!r} (known: rtn, search, gptq)")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"unknown weighting {self.weighting!r} (known: {', '.join(WEIGHTINGS)})")
        if self.dense is not None and self.dense.min:
            raise ValueError("dense weights take int8 or symmetric int4")
        if self.lm_head and self.dense is None:
            raise ValueError("lm_head is quantised with the dense scheme: give one")

    @property
    def needs_importance(self) -> bool:
        return self.method == "gptq" or (self.method == "search"
                                         and self.weighting.startswith("importance"))


def quantize_expert(spec: RepackSpec, arrays, layer: int, expert: int,
                    importance: ImportanceStats | None = None) -> dict[str, QuantizedTensor]:
    """{"gate", "up", "down"} -> QuantizedTensor of one expert's projections (`arrays`:
    ExpertWeights or a mapping of any float arrays [I, H], [I, H], [H, I])."""
    out = {}
    for proj in PROJECTIONS:
        w = np.asarray(arrays[proj] if isinstance(arrays, dict) else getattr(arrays, proj), np.float32)
        if spec.method == "gptq":
            if importance is None or not importance.second_moments:
                raise ValueError("method 'gptq' needs second moments gathered from text")
            out[proj] = quantize_gptq(w, spec.experts, importance.moment_matrix(
                layer, expert, proj, spec.prior_tokens))
            continue
        out[proj] = quantize(w, spec.experts, method=spec.method,
                             weights=_error_weights(spec, w, spec.experts, importance, layer,
                                                    expert, proj))
    return out


def quantize_dense(spec: RepackSpec, w: np.ndarray) -> QuantizedTensor:
    """One dense weight [R, C] with `spec.dense` (magnitude weights unless uniform)."""
    w = np.asarray(w, np.float32)
    weights = None if spec.weighting == "uniform" else magnitude_weights(w, spec.dense)
    return quantize(w, spec.dense, method="rtn" if spec.method == "rtn" else "search",
                    weights=weights)


def _error_weights(spec, w, scheme, importance, layer, expert, proj):
    if spec.method == "rtn" or spec.weighting == "uniform":
        return None
    if spec.weighting == "magnitude":
        return magnitude_weights(w, scheme)
    if importance is None:
        raise ValueError(f"weighting {spec.weighting!r} needs importance statistics from text")
    imp = importance.column_importance(layer, expert, proj, spec.prior_tokens)
    return importance_weights(w, imp, scheme, magnitude=spec.weighting == "importance*magnitude")


def dense_weight_names(checkpoint: Checkpoint, expert_pieces: set[str],
                       lm_head: bool = False) -> list[str]:
    """The dense weights `spec.dense` applies to: attention q/k/v/o projections, shared
    experts' and dense MLPs' gate/up/down stored as plain floats, and `lm_head.weight`
    when `lm_head` (never routers, norms, embeddings; FP8 ones stay FP8)."""
    patterns = _DENSE_PATTERNS + ((r"lm_head\.weight",) if lm_head else ())
    pattern = re.compile("|".join(f"(?:{p})" for p in patterns))
    return [n for n, info in checkpoint.tensors.items()
            if n not in expert_pieces and len(info.shape) == 2 and info.dtype in FLOAT_DTYPES
            and pattern.fullmatch(n)]


def name_patterns(names: list[str], all_names: list[str]) -> list[str]:
    """fnmatch patterns covering exactly `names` among `all_names`: layer and expert numbers
    become "*" (e.g. "model.layers.*.mlp.experts.*.up_proj.weight"); the explicit names
    when the patterns would cover anything else."""
    import fnmatch
    patterns = sorted({re.sub(r"\.\d+(?=\.)", ".*", n) for n in names})
    chosen = set(names)
    if all(any(fnmatch.fnmatchcase(n, p) for p in patterns) == (n in chosen) for n in all_names):
        return patterns
    return sorted(chosen)


# ------------------------------------------------------------------ the shard layout

@dataclass
class _Piece:
    """One tensor of a shard: its header entry, and where its bytes come from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0


@dataclass
class _Block:
    """Tensors written together: one expert (aligned to `align`) or one dense tensor.
    produce() returns their bytes in piece order."""

    pieces: list[_Piece]
    align: int
    produce: Callable[[], list[bytes | np.ndarray]]
    nbytes: int = 0

    def __post_init__(self):
        self.nbytes = sum(p.nbytes for p in self.pieces)


@dataclass
class _Shard:
    blocks: list[_Block] = field(default_factory=list)
    entries: list[_Piece] = field(default_factory=list)     # pieces and padding, file order
    data_bytes: int = 0


def _quant_pieces(name: str, scheme: QuantScheme, shape: tuple[int, int]) -> list[_Piece]:
    shapes = scheme.shapes(shape)
    R, C = shape
    g = scheme.group(C)
    pieces = [_Piece(name, scheme.code_dtype, shapes["codes"], R * C * scheme.bits // 8),
              _Piece(scale_name(name), "F16", shapes["scale"], R * (C // g) * 2)]
    if scheme.min:
        pieces.append(_Piece(min_name(name), "F16", shapes["min"], R * (C // g) * 2))
    return pieces


def _arrays(q: QuantizedTensor) -> list[np.ndarray]:
    return [q.codes, q.scale] + ([] if q.min is None else [q.min])


def _plan_shards(blocks: list[_Block], shard_size: int, alignment: int) -> list[_Shard]:
    shards = [_Shard()]
    for block in blocks:
        if shards[-1].blocks and shards[-1].data_bytes + block.nbytes > shard_size:
            shards.append(_Shard())
        shards[-1].blocks.append(block)
        shards[-1].data_bytes += block.nbytes
    for i, shard in enumerate(shards):
        offset, pads = 0, 0

        def pad_to(align: int) -> None:
            nonlocal offset, pads
            gap = -offset % align
            if gap:
                shard.entries.append(_Piece(f"{PADDING_PREFIX}{i}.{pads}", "U8", (gap,), gap, offset))
                pads += 1
                offset += gap

        for block in shard.blocks:
            pad_to(block.align)
            for piece in block.pieces:
                pad_to(TENSOR_ALIGNMENT)
                piece.offset = offset
                shard.entries.append(piece)
                offset += piece.nbytes
        shard.data_bytes = offset
    return shards


def _header(shard: _Shard, alignment: int) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt", "moed": "repack"}}
    for p in shard.entries:
        header[p.name] = {"dtype": p.dtype, "shape": list(p.shape),
                          "data_offsets": [p.offset, p.offset + p.nbytes]}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-(8 + len(raw)) % alignment)     # data starts on `alignment`


def _raw_bytes(checkpoint: Checkpoint, info: TensorInfo) -> bytes:
    with open(info.path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.nbytes)
    if len(data) != info.nbytes:
        raise OSError(f"{info.path}: tensor {info.name!r} ends before its {info.nbytes} bytes")
    return data


# ------------------------------------------------------------------ repack

@dataclass(frozen=True)
class RepackResult:
    """What `repack` wrote: the directory, its config, shard count and byte totals."""

    out_dir: Path
    config: RepackConfig
    shards: int
    expert_bytes_before: int
    expert_bytes_after: int
    total_bytes: int
    source_format: str
    losses: tuple[str, ...] = ()
    stale_removed: tuple[Path, ...] = ()     # killed repacks' temporaries removed first


def _source_description(raw_config: dict, layout: ExpertLayout) -> dict:
    """What was repacked: its experts' stored format, and its quantization_config (which
    the weights kept as they were still follow; ext/formats/repacked.py MoedMethod)."""
    return {"experts_format": layout.format,
            "quantization_config": raw_config.get("quantization_config")}


# Bits per weight of the formats a repack may read, and what a second rounding loses.
_SOURCE_BITS = {"f32": 32.0, "f16": 16.0, "bf16": 16.0, "fp8_e4m3": 8.0, "mxfp4": 4.25}


def _losses(layout: ExpertLayout, spec: RepackSpec) -> tuple[str, ...]:
    """What the repack gives up, one sentence each."""
    src = layout.format
    bits = _SOURCE_BITS.get(src)
    target = (f"{spec.experts.scheme} in groups of {spec.experts.group_size}"
              f"{' with a minimum' if spec.experts.min else ''} "
              f"({spec.experts.bits_per_weight:g} bits per weight)")
    out = [f"routed experts {src}" + (f" ({bits:g} bits per weight)" if bits else "")
           + f" -> {target}: every weight is rounded to one of {2 ** spec.experts.bits} "
           "levels of its group"]
    if src == "fp8_e4m3":
        out.append("the FP8 E4M3 values (3 mantissa bits, a scale per 128x128 block) are "
                   f"rounded a second time into {spec.experts.scheme} groups: the repack is "
                   "lossy against the FP8 checkpoint, not only against its bf16 original")
    elif src == "mxfp4":
        out.append("the MXFP4 values (E2M1 levels 0..6 with a power-of-two scale per 32) do "
                   f"not fall on {spec.experts.scheme}'s uniform levels in general: they are "
                   "rounded a second time (compare with 'moed eval' before serving)")
    if spec.dense is not None:
        out.append(f"dense projections{' and lm_head' if spec.lm_head else ''} -> "
                   f"{spec.dense.scheme} in groups of {spec.dense.group_size}")
    return tuple(out)


def repack(model_dir: str | os.PathLike, out_dir: str | os.PathLike, spec: RepackSpec, *,
           importance: ImportanceStats | LayerwiseMoments | None = None,
           provenance: dict | None = None, shard_size: int = DEFAULT_SHARD_SIZE,
           overwrite: bool = False, threads: int = 1,
           progress: Callable[[int, int], None] | None = None) -> RepackResult:
    """Repack `model_dir` into `out_dir` (see the module doc).

    importance: statistics from calibration text, needed by the importance weightings and
    GPTQ (`LayerwiseMoments` gathers GPTQ's a few layers at a time).
    threads: blocks quantised at once (numpy releases the GIL); the output is the same
    for any count.
    provenance: extra fields for quantization_config.quantizer (e.g. the text used).
    progress(done, total): expert and dense tensors quantised or copied, in bytes of input.
    Raises FileExistsError (`out_dir` exists and is not empty, without `overwrite`),
    ValueError (`out_dir` is, contains or lies inside `model_dir`, is something
    `overwrite` may not replace — see check_out_dir; a model already repacked by moed, a
    weight whose shape the scheme cannot cut — naming it, importance missing), the
    loaders' ConfigError / CheckpointError naming the file and tensor, and OSError (one of
    writing the output names the file as it would be in `out_dir`: see _writing).
    """
    src = Path(model_dir).resolve()
    out = Path(out_dir)
    check_out_dir(src, out, overwrite)
    raw_config = read_json(src / CONFIG_NAME)
    if read_repack_config(raw_config, src / CONFIG_NAME) is not None:
        raise ValueError(f"{src / CONFIG_NAME}: the model is already repacked by moed "
                         "(repack its source model instead)")
    if spec.needs_importance and importance is None:
        raise ValueError(f"weighting {spec.weighting!r} needs importance statistics from text")
    config = load_config(src)
    with Checkpoint(src) as checkpoint:
        layout = ExpertLayout(checkpoint, config)
        layout.check_scales(checkpoint)
        source_pieces = {p.name for loc in layout for p in loc.pieces()}
        expert_names = {expert_tensor_name(config.model_type, loc.layer, loc.expert, proj): w.shape
                        for loc in layout for proj, w in zip(PROJECTIONS, loc.projections())}
        dense_names = (set(dense_weight_names(checkpoint, source_pieces, spec.lm_head))
                       if spec.dense else set())
        for name, shape in sorted({**expert_names,
                                   **{n: checkpoint.info(n).shape for n in dense_names}}.items()):
            scheme = spec.experts if name in expert_names else spec.dense
            why = scheme.check_columns(shape[1])
            if why:
                where = checkpoint.info(name).path if name in checkpoint else checkpoint.model_dir
                raise ValueError(f"{where}: tensor {name!r}: {why}; {scheme.scheme} cannot "
                                 "repack it")
        blocks = _dense_blocks(checkpoint, source_pieces, dense_names, spec)
        blocks += _expert_blocks(checkpoint, layout, spec, importance)
        out_names = [p.name for b in blocks for p in b.pieces]
        rc = RepackConfig(
            experts=QuantGroup(spec.experts, tuple(name_patterns(sorted(expert_names), out_names))),
            dense=None if not dense_names else QuantGroup(
                spec.dense, tuple(name_patterns(sorted(dense_names), out_names))),
            alignment=ALIGNMENT,
            quantizer={"method": spec.method,
                       **({"weighting": spec.weighting} if spec.method == "search" else {}),
                       **({"prior_tokens": spec.prior_tokens} if spec.needs_importance else {}),
                       **(provenance or {})},
            source=_source_description(raw_config, layout))
        target = out.resolve()          # not a link (check_out_dir): its real place
        target.parent.mkdir(parents=True, exist_ok=True)
        stale = remove_stale_temporaries(target.parent)
        with _work_dir(target) as work:
            tmp = work / "new"
            tmp.mkdir()
            shards = _plan_shards(blocks, shard_size, ALIGNMENT)
            total_in = sum(b.nbytes for b in blocks)   # progress in bytes written
            written = _write_shards(tmp, shards, ALIGNMENT, progress, total_in, threads, out)
            new_config = {**raw_config, "quantization_config": rc.to_json()}
            with _writing(out / CONFIG_NAME):
                (tmp / CONFIG_NAME).write_text(json.dumps(new_config, indent=2) + "\n",
                                               encoding="utf-8")
            for entry in sorted(src.iterdir()):
                if (entry.is_file() and entry.name not in _COPIED_SKIP
                        and not entry.name.endswith(".safetensors")):
                    with _writing(out / entry.name, f"copying {entry} to"):
                        shutil.copyfile(entry, tmp / entry.name)
            check_out_dir(src, out, overwrite)        # again: the repack may have taken hours
            if not os.path.lexists(target):
                os.replace(tmp, target)
            else:                   # the replaced output goes with `work`, not in place
                os.rename(target, work / "old")
                try:
                    os.replace(tmp, target)
                except BaseException:
                    os.rename(work / "old", target)
                    raise
        before = sum(loc.nbytes for loc in layout)
        after = sum(p.nbytes for b in blocks if b.align == ALIGNMENT for p in b.pieces)
        return RepackResult(out_dir=out, config=rc, shards=len(shards),
                            expert_bytes_before=before, expert_bytes_after=after,
                            total_bytes=written, source_format=layout.format, losses=_losses(layout, spec),
                            stale_removed=tuple(stale))


def check_out_dir(model_dir: str | os.PathLike, out_dir: str | os.PathLike,
                  overwrite: bool = False) -> None:
    """Refuse an `out_dir` repack must not write, with or without `overwrite`: the model
    directory itself, a directory that contains it or lies inside it, a symbolic link, a
    file, a non-empty directory that is not a previous repack's output (config.json with
    quantization_config.quant_method "moed"). An empty directory is taken as it is; a
    previous repack's output only with `overwrite`. Raises ValueError naming the directory
    and why, or FileExistsError (a previous output, `overwrite` not given)."""
    src = Path(model_dir).resolve()
    out = Path(out_dir)
    target = out.resolve()
    if target == src:
        raise ValueError(f"--out {out} is the model directory itself")
    if src.is_relative_to(target):
        raise ValueError(f"--out {out} contains the model directory {src}: a repack never "
                         "replaces it; choose another --out")
    if target.is_relative_to(src):
        raise ValueError(f"--out {out} is inside the model directory {src}: a repack does "
                         "not write into its source; choose another --out")
    if out.is_symlink():
        raise ValueError(f"--out {out} is a symbolic link: give the directory itself")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    why = _not_a_repack_output(out)
    if why:
        raise ValueError(f"--out {out} {why}: not replacing it, even with --force (which "
                         "replaces only a previous repack's output or an empty directory); "
                         "remove it yourself or choose another --out")
    if not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; use --force to replace it")


def _not_a_repack_output(out: Path) -> str | None:
    """Why `out` (existing, not empty) is not a previous repack's output, or None."""
    if not out.is_dir():
        return "is a file, not a directory"
    try:
        config = json.loads((out / CONFIG_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"is not empty and has no {CONFIG_NAME}: it is not a repack's output"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"is not empty and its {CONFIG_NAME} cannot be read ({e})"
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        return (f"is not empty and its {CONFIG_NAME} has no quantization_config with "
                f'quant_method "{QUANT_METHOD}": it is not a repack\'s output')
    return None


@contextmanager
def _work_dir(target: Path) -> Iterator[Path]:
    """`.<name>.moed-repack-<pid>.<random>` beside `target`, locked (TEMP_LOCK, flock) for
    as long as this process writes in it, and removed at the end whatever happens. The
    lock is taken on a file of another name and renamed into place, so that no one sees
    the lock file before it is held."""
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}{TEMP_MARK}{os.getpid()}.",
                                 dir=target.parent))
    fd = None
    try:
        fd = os.open(work / f"{TEMP_LOCK}.new", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                     0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(work / f"{TEMP_LOCK}.new", work / TEMP_LOCK)
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if fd is not None:
            os.close(fd)


def remove_stale_temporaries(parent: str | os.PathLike) -> list[Path]:
    """Remove the temporary directories (`.<name>.moed-repack-<pid>.<random>`, this
    user's) that repacks killed before their end left in `parent`: those whose lock file
    is free, because the process that held it is gone (a pid, which may have been reused,
    would not say), or, with no lock file (killed the moment after creating it), whose pid
    is not alive. A running repack's directory stays. Returns the paths removed."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_NAME.fullmatch(entry.name)
        try:
            if (not m or not entry.is_dir(follow_symlinks=False)
                    or entry.stat(follow_symlinks=False).st_uid != os.getuid()):
                continue
        except OSError:
            continue
        if _remove_if_stale(Path(entry.path), int(m.group(1))):
            removed.append(Path(entry.path))
    return removed


def _remove_if_stale(path: Path, pid: int) -> bool:
    try:
        fd = os.open(path / TEMP_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if _pid_alive(pid):
            return False     # its writer between mkdtemp and its lock, most likely
        fd = None
    except OSError:
        return False
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False     # held: a repack writing now
        shutil.rmtree(path, ignore_errors=True)   # holding the lock: no one else removes it
        return not os.path.lexists(path)
    finally:
        if fd is not None:
            os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True          # EPERM: someone else's process
    return True


def _dense_blocks(checkpoint: Checkpoint, expert_pieces: set[str], dense_names: set[str],
                  spec: RepackSpec) -> list[_Block]:
    blocks = []
    for name, info in checkpoint.tensors.items():
        if name in expert_pieces:
            continue
        if name in dense_names:
            shape = (info.shape[0], info.shape[1])
            blocks.append(_Block(_quant_pieces(name, spec.dense, shape), TENSOR_ALIGNMENT,
                                 lambda n=name: _arrays(quantize_dense(spec, checkpoint.load(n)))))
        else:
            blocks.append(_Block([_Piece(name, info.dtype, info.shape, info.nbytes)],
                                 TENSOR_ALIGNMENT, lambda i=info: [_raw_bytes(checkpoint, i)]))
    return blocks


def _expert_blocks(checkpoint: Checkpoint, layout: ExpertLayout, spec: RepackSpec,
                   importance: ImportanceStats | LayerwiseMoments | None) -> list[_Block]:
    model_type = layout.config.model_type
    blocks = []
    for loc in sorted(layout, key=lambda l: (l.layer, l.expert)):
        pieces = []
        for proj, w in zip(PROJECTIONS, loc.projections()):
            pieces += _quant_pieces(expert_tensor_name(model_type, loc.layer, loc.expert, proj),
                                    spec.experts, w.shape)

        def produce(loc=loc):
            arrays = {p: weight_values(checkpoint, w) for p, w in zip(PROJECTIONS, loc.projections())}
            stats = None if importance is None else importance.for_layer(loc.layer)
            q = quantize_expert(spec, arrays, loc.layer, loc.expert, stats)
            return [a for p in PROJECTIONS for a in _arrays(q[p])]
        blocks.append(_Block(pieces, ALIGNMENT, produce))
    return blocks


def _produced(blocks: list[_Block], threads: int) -> Iterator[list]:
    """Each block's produce(), in order, up to 2 x threads of them computed ahead."""
    if threads <= 1:
        yield from (b.produce() for b in blocks)
        return
    with ThreadPoolExecutor(threads) as pool:
        ahead: deque = deque()
        it = iter(blocks)
        for block in it:
            ahead.append(pool.submit(block.produce))
            if len(ahead) >= 2 * threads:
                break
        while ahead:
            done = ahead.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                ahead.append(pool.submit(nxt.produce))
            yield done


@contextmanager
def _writing(shown: Path, what: str = "writing") -> Iterator[None]:
    """An OSError raised inside (ENOSPC, EDQUOT, EIO, ...) names the output file being
    written as the user will find it, `shown` (its place in --out: it is written in a
    temporary directory beside it), with its errno: "[Errno 28] No space left on device:
    writing OUT/model-00001-of-00002.safetensors". The original is its __cause__."""
    try:
        yield
    except OSError as e:
        if e.errno is None:         # an OSError of ours, with a message only
            raise OSError(f"{e}: {what} {shown}") from e
        raise OSError(e.errno, f"{e.strerror}: {what} {shown}") from e


def _write_shards(out: Path, shards: list[_Shard], alignment: int,
                  progress: Callable[[int, int], None] | None, total: int, threads: int,
                  shown: Path) -> int:
    """Write the shards and their index into `out`; `shown` is the directory that errors
    name (the output's place, `out` being its temporary copy)."""
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, done, written = {}, 0, 0
    produced = _produced([b for s in shards for b in s.blocks], threads)
    for file_name, shard in zip(names, shards):
        header = _header(shard, alignment)
        with _writing(shown / file_name):
            f = open(out / file_name, "wb")
        try:
            with _writing(shown / file_name):
                f.write(struct.pack("<Q", len(header)))
                f.write(header)
            start = f.tell()
            pieces = iter(shard.entries)
            for block in shard.blocks:
                arrays = next(produced)     # read and quantised: its errors name the source
                with _writing(shown / file_name):
                    for data in arrays:
                        piece = next(pieces)
                        while piece.name.startswith(PADDING_PREFIX):
                            f.write(bytes(piece.nbytes))
                            piece = next(pieces)
                        buf = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(
                            data, np.ndarray) else memoryview(data)
                        if f.tell() - start != piece.offset or buf.nbytes != piece.nbytes:
                            raise AssertionError(f"layout of {piece.name} broke")   # a bug here
                        f.write(buf)
                        weight_map[piece.name] = file_name
                done += block.nbytes
                if progress is not None:
                    progress(done, total)
            with _writing(shown / file_name):   # a full disk may show only now
                written += f.tell()
                f.flush()
                os.fsync(f.fileno())
        finally:
            with _writing(shown / file_name):   # closing flushes what is buffered
                f.close()
    tensor_bytes = sum(p.nbytes for s in shards for p in s.entries if not p.name.startswith(PADDING_PREFIX))
    index = {"metadata": {"total_size": tensor_bytes, "format": "moed-repack"},
             "weight_map": dict(sorted(weight_map.items()))}
    with _writing(shown / INDEX_NAME):
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return written
