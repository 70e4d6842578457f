"""The C++ CPU extensions (kernels/cpu_*.cpp): compiled for this machine's vector extensions at
first use, torch.utils.cpp_extension caching the build across processes."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def build(name: str, source: Path) -> None:
    """Compile and load source's operators for this machine's vector extensions."""
    from torch.utils.cpp_extension import load  # imports setuptools: only when first needed

    load(
        name=name,
        sources=[str(source)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )


def build_name(source: Path) -> str:
    """Named after the source's hash: checkouts of different sources share torch's build cache
    without one loading (or rebuilding over) the other's library."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    return f"asyncllm_{source.stem}_{digest}"


def load_extension(source: Path, fallback: str) -> bool:
    """Build and load source; False, after a warning naming the fallback, when that fails."""
    try:
        build(build_name(source), source)
    except Exception as error:  # no compiler, no ninja, a failed build: the torch path remains
        logger.warning("CPU kernels of %s unavailable (%s); using %s", source.name, error, fallback)
        return False
    return True
