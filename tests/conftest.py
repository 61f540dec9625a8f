"""Put tests/ on sys.path so test modules can import shared helpers (oracle_models)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
