"""The model: its configuration (config.py), where its routed experts are and how the MoE
block gets them (experts.py), and the forward pass (model.py). Per-family code lives
here. Imports kernels/ and formats/."""
