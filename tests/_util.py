"""Small helpers for the tests (import with `from _util import wait_for`)."""

import time
from typing import Callable, Optional, Tuple, Type


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.2,
             ignore: Tuple[Type[BaseException], ...] = (), detail: Optional[Callable[[], str]] = None):
    """Poll `predicate()` every `interval` s until it returns something truthy, and return that.
    After `timeout` s raise an AssertionError naming `what` was awaited, with the last value
    (or ignored exception) and `detail()` (e.g. a log tail) if given. Exceptions of the types in
    `ignore` count as "not yet"; any other exception propagates at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignore as e:  # noqa: PERF203 - polling
            value, last = None, e
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            msg = f"timed out after {timeout:g} s waiting for {what} (last: {last!r})"
            if detail is not None:
                msg += "\n" + detail()
            raise AssertionError(msg)
        time.sleep(interval)
