"""Shared test set-up: plans never depend on this machine's calibration file."""

import os
from pathlib import Path

import pytest

os.environ["GRAPHRL_CALIBRATION"] = "none"

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.fixture
def examples_dir() -> Path:
    return EXAMPLES
