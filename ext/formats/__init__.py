"""The model directory on disk: safetensors shards and their index (checkpoint.py), the
small metadata files (files.py), and the stored formats of weights with the quantisation
config that says which a model uses (quant.py: f32/f16/bf16, FP8 E4M3 with block scales,
MXFP4, and a registry; repacked.py: moed's own int4/int8 repack format, registered in it
on import). Imports nothing of ext/ outside formats/."""
from ext.formats import repacked as _repacked  # noqa: E402,F401  registers quant_method "moed"
