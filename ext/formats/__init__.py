"""The model directory on disk: safetensors shards and their index (checkpoint.py), the
small metadata files (files.py), and the decoding of stored dtypes and quantisation
formats. Imports nothing of ext/ outside formats/."""
