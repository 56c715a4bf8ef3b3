"""A CPU rank keeps freed host memory: a step's tensors of the sizes the last step freed reuse its pages
instead of faulting fresh zeroed ones in."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Allocates and frees a 64 MiB tensor, then counts the page faults of allocating and filling it again.
REUSE = textwrap.dedent("""
    import resource, sys, torch
    from graphrl.executors.host_memory import keep_freed_host_memory
    kept = keep_freed_host_memory()
    def faults_of_a_fresh_tensor():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 << 20)  # 64 MiB, freed at once
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults_of_a_fresh_tensor()
    print(kept, faults_of_a_fresh_tensor())
""")

PAGES_64_MIB = (64 << 20) // 4096


def _run(env: dict[str, str]) -> tuple[bool, int]:
    import os

    out = subprocess.run([sys.executable, "-c", REUSE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_memory_is_reused_without_page_faults():
    kept, faults = _run({})
    assert kept
    assert faults < PAGES_64_MIB // 10


def test_release_leaves_malloc_as_it_is():
    kept, faults = _run({"GRAPHRL_HOST_MEMORY": "release"})
    assert not kept
    assert faults > PAGES_64_MIB // 2  # glibc maps a block this large afresh: every page faults again
