"""tcmalloc preloading (`flows/fast_malloc.py`): when it applies, and that a command really runs under it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flywheel.flows.fast_malloc import OPT_OUT, fast_malloc_env

INSTALLED = fast_malloc_env({}) is not None
needs_tcmalloc = pytest.mark.skipif(not INSTALLED, reason="tcmalloc is not installed (apt: libtcmalloc-minimal4)")
SHOW_MAPS = "print(open('/proc/self/maps').read())"


def _maps(env: dict[str, str]) -> str:
    command = [sys.executable, "-m", "flywheel.flows.fast_malloc", sys.executable, "-c", SHOW_MAPS]
    return subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", OPT_OUT)}  # The test run's own preload.
    return env | extra


def test_nothing_to_do_when_opted_out_or_already_preloaded() -> None:
    assert fast_malloc_env({OPT_OUT: "system"}) is None
    assert fast_malloc_env({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}) is None


@needs_tcmalloc
def test_the_preload_keeps_what_was_preloaded_before() -> None:
    env = fast_malloc_env({"LD_PRELOAD": "libother.so", "PATH": "/bin"})
    assert env is not None
    assert env["LD_PRELOAD"].split() == ["libtcmalloc_minimal.so.4", "libother.so"]
    assert env["PATH"] == "/bin"


@needs_tcmalloc
def test_a_command_runs_under_tcmalloc_unless_opted_out() -> None:
    assert "libtcmalloc_minimal" in _maps(_clean_env())
    assert "libtcmalloc_minimal" not in _maps(_clean_env(**{OPT_OUT: "system"}))


def test_the_launcher_needs_a_command() -> None:
    run = subprocess.run([sys.executable, "-m", "flywheel.flows.fast_malloc"], capture_output=True, text=True)
    assert run.returncode != 0 and "usage" in run.stderr
