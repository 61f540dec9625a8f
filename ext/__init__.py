"""moed's model code: everything that computes, in rooms that import downward only.

    kernels/    Cython kernels (mat-vec, attention, expert FFN, routing), nogil
    formats/    the checkpoint on disk: safetensors parsing, metadata files, and the
                dtype and quantisation formats of stored weights
    models/     the model: its config, where its experts are, the forward pass; the
                per-family code goes here
    makemodel/  random-weight checkpoints in the Hugging Face layout (tests, benchmarks)
    quant/      quantisation into moed's repack format, and `moed repack`'s writer
    (top level) tokenizer and chat template, sampling, generation, evaluation (evaluate.py)

kernels/ imports nothing of ext; formats/ imports only formats/; models/ imports
kernels/ and formats/; quant/ imports models/ and formats/ (never kernels/ directly);
makemodel/ imports only makemodel/ (it shares no code with the reader it tests); the
top-level modules may import any room. ext/ as a whole imports
only numpy, ml_dtypes, safetensors, tokenizers, jinja2 (tests/test_layout.py).
"""
