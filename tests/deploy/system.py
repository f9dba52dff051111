"""Real servers from Debian packages: installed on demand (as root, as in CI), started on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def require_binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True, timeout=600)
            subprocess.run(
                ["apt-get", "install", "-y", "-qq", package], check=True, env=env, capture_output=True, timeout=900
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"{name} is not installed and apt-get failed to install {package}: {exc}")
        path = shutil.which(name)
    if not path:
        pytest.skip(f"{name} is not installed and cannot be installed here (apt-get install {package})")
    return path
