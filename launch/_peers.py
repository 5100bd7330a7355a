"""Peer replay buffers for `launch.bench replay` (the optional `bench` extra): cpprb and TorchRL.

TorchRL's wheels ship their C++ sum tree compiled against one torch version; with another
(here torch 2.13) `torchrl._torchrl` fails to load and its PrioritizedSampler refuses to
run. The extension's source ships inside the wheel (`torchrl/csrc`), so we build it once
against the installed torch with torch's own cpp_extension (~40 s, cached in
TORCH_EXTENSIONS_DIR) and register it under the name TorchRL imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def ensure_torchrl_extension() -> str:
    """Make `torchrl._torchrl` importable; returns how ('wheel' or 'built')."""
    try:
        importlib.import_module("torchrl._torchrl")
        return "wheel"
    except ImportError:
        pass
    spec = importlib.util.find_spec("torchrl")
    if spec is None or spec.origin is None:
        raise ImportError("torchrl is not installed (pip install -e '.[bench]')")
    csrc = Path(spec.origin).parent / "csrc"
    from torch.utils.cpp_extension import load
    mod = load(name="_torchrl", sources=[str(csrc / "pybind.cpp"), str(csrc / "utils.cpp")],
               extra_include_paths=[str(csrc)], extra_cflags=["-O3"], verbose=False)
    sys.modules["torchrl._torchrl"] = mod
    return "built"
