"""A CPU rank keeps freed host memory: a step's tensors of the sizes the last step freed reuse its pages
instead of faulting fresh zeroed ones in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

STEPS = 24
# Allocates and frees a 64 MiB tensor a step, as a training step does its activations, and counts the page
# faults of all steps. The heap settles within the first ten or so (an aligned block does not fit the hole
# its predecessor left until freed neighbours have merged); after that each step reuses freed pages.
REUSE = textwrap.dedent(f"""
    import resource, torch
    from graphrl.executors.host_memory import keep_freed_host_memory
    kept = keep_freed_host_memory()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({STEPS}):
        torch.ones(16 << 20)  # 64 MiB, freed at once
    print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")
PAGES_PER_STEP = (64 << 20) // 4096


def _run(env: dict[str, str]) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", REUSE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_memory_is_reused_without_page_faults():
    kept, faults = _run({})
    assert kept
    assert faults < STEPS * PAGES_PER_STEP / 2


def test_release_leaves_malloc_as_it_is():
    kept, faults = _run({"GRAPHRL_HOST_MEMORY": "release"})
    assert not kept
    assert faults > 0.9 * STEPS * PAGES_PER_STEP  # glibc maps a block this large afresh each step
