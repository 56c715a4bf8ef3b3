"""Render an HTML file (a plan preview or a run report) to PNG with headless Chromium.

    python scripts/screenshot.py plan.html plan.png [--width 1280 --height 2400]

Used by the docs and by a test that proves the pages render in a real browser.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(html: Path, png: Path, width: int = 1280, height: int = 2400, timeout_s: float = 90.0) -> None:
    browser = find_chromium()
    if browser is None:
        raise RuntimeError("no Chromium found (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", f"--window-size={width},{height}",
            f"--screenshot={png.resolve()}", html.resolve().as_uri(),
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=timeout_s)
    if not png.exists() or png.stat().st_size == 0:
        raise RuntimeError(f"Chromium wrote no screenshot to {png}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=2400)
    args = parser.parse_args(argv)
    screenshot(args.html, args.png, args.width, args.height)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
