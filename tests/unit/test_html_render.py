"""The HTML plan preview renders in a real browser (headless Chromium), when one is installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("screenshot", ROOT / "scripts" / "screenshot.py")
screenshot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(screenshot)  # type: ignore[union-attr]


@pytest.mark.skipif(screenshot.find_chromium() is None, reason="Chromium is not installed")
def test_plan_page_renders_in_chromium(tmp_path):
    html = tmp_path / "plan.html"
    out = CliRunner().invoke(main, ["compile", str(ROOT / "examples" / "llama3_405b.yaml"), "--format", "html", "-o", str(html)])
    assert out.exit_code == 0, out.output
    png = tmp_path / "plan.png"
    screenshot.screenshot(html, png, 1000, 1400)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # a blank page compresses to a few KB; ours has tables and SVG
