"""The model: its configuration (config.py), the seam between the forward pass and the
model families (family.py; one module per family in families/, and their table), the
shared pieces the families are built from — attention kinds (attention.py), RoPE
(rope.py), routing rules (routing.py), the KV cache (kvcache.py) — where its routed
experts are and how the MoE block gets them (experts.py), and the forward pass
(model.py). Imports kernels/ and formats/."""

# The family table registers each family's config reader with config.py (which imports
# no family, so the families may import it).
from ext.models import families  # noqa: E402,F401
