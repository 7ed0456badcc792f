"""tests/cuda reuse the CPU parity tests' model, batches and reference (tests/dist/parity.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import cases / cuda_support by name
