"""Builds torchmpmd and its native core torchmpmd._C against the installed torch.

Install with `pip install --no-build-isolation -e .` so that pip uses the torch
already in the environment instead of fetching one into a build sandbox.
"""

import os
from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent


def _sources() -> list[str]:
    lines = (ROOT / "csrc" / "sources.txt").read_text().splitlines()
    entries = [line.split() for line in lines if line.strip() and not line.startswith("#")]
    return [f"csrc/{path}" for _layer, path in entries]


setup(
    packages=find_packages(include=["torchmpmd", "torchmpmd.*"]),
    ext_modules=[
        CppExtension(
            "torchmpmd._C",
            _sources(),
            include_dirs=[str(ROOT / "csrc")],
            # TORCHMPMD_BUILD_FLAGS: flags after ours (the CUDA compile check,
            # whose build never runs, builds with "-O0 -g0").
            extra_compile_args=[
                "-O2",
                "-Wall",
                "-Wno-unused-parameter",
                *os.environ.get("TORCHMPMD_BUILD_FLAGS", "").split(),
            ],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
