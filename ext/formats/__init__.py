"""The model directory on disk: safetensors shards and their index (checkpoint.py), the
small metadata files (files.py), and the stored formats of weights with the quantisation
config that says which a model uses (quant.py: f32/f16/bf16, FP8 E4M3 with block scales,
MXFP4, and a registry for moed's own repack format). Imports nothing of ext/ outside
formats/."""
