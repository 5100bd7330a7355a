"""Small output helpers shared by the entry points."""

from __future__ import annotations

import json
import math
from pathlib import Path

# --no-dashboard of every entry point that starts a local Ray cluster (measured: a smoke run
# logs ~30 "Failed to query Ray Train Controller actor state" warnings without it, 0 with it)
NO_DASHBOARD_HELP = ("start the local cluster without the Ray dashboard (saves ~1 s and ~100 MB); Ray Train's "
                     "placement-group cleaner then cannot query the state API and logs a warning every second or so")


def json_safe(x):
    """NaN (e.g. no accounting window settled in a short run) becomes null: valid JSON."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (str, int)):
        return x
    if hasattr(x, "__float__"):
        f = float(x)
        return None if math.isnan(f) else f
    return x


def write_json(path: str | Path, payload) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(json_safe(payload), indent=2))


def save_figure(fig, path: str | Path) -> None:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
