"""Logging: one logger per module (``logging.getLogger(__name__)``, under ``ray_diloco``); the
command line installs the one handler (:func:`setup`), a library user configures ``logging`` as
they like.

What a command prints is a log record: a command's results (the final loss, the run directory,
a sweep's table) are INFO records marked ``extra=RESULT`` and go to stdout; everything else
(progress notes, membership events, warnings) goes to stderr, one line each, through tqdm so a
progress bar is not broken. ``--quiet`` keeps warnings and results (and hides the progress
bar), ``--verbose`` adds debug records. Without a handler (a library user who configured
nothing) Python prints warnings and errors only (``logging.lastResort``).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["RESULT", "error_line", "installed", "setup"]

#: ``extra`` of a record that is a command's result (stdout), not a diagnostic (stderr).
RESULT = {"result": True}


def error_line(e: BaseException, typed: bool = True, limit: int | None = None) -> str:
    """An exception's first line for a one-line message: ``Type: first line of its text`` (the
    type alone when it has no text); ``typed=False``: the first line alone (the type when there is
    none). ``limit``: at most that many characters of the text."""
    lines = str(e).strip().splitlines()
    text = lines[0][:limit] if lines else ""
    if not typed:
        return text or type(e).__name__
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def causes(e: BaseException | None, limit: int = 10) -> list[BaseException]:
    """``e`` and what it wraps, outermost first: a Ray task error's ``cause``, else ``__cause__``,
    else ``__context__`` (at most ``limit``; a loop ends it). The last is the innermost reason
    (bytes that are not UTF-8 under a library's own error)."""
    out: list[BaseException] = []
    while e is not None and len(out) < limit and e not in out:
        out.append(e)
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return out


class _Handler(logging.Handler):
    """Results to stdout, everything else to stderr (the streams of the moment: a test's capture
    sees them), the message alone, written with ``tqdm.write`` (a live bar is redrawn below)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            stream = sys.stdout if getattr(record, "result", False) else sys.stderr
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except Exception:  # a closed stream (a reader that left): never an error of its own
            self.handleError(record)


_installed: int | None = None


def installed() -> int | None:
    """The verbosity :func:`setup` installed in this process (None: none; a Tune trial's process
    installs the same)."""
    return _installed


def setup(verbosity: int = 0) -> None:
    """Install the command line's handler on the ``ray_diloco`` logger, replacing an earlier one:
    ``verbosity`` -1 (``--quiet``: warnings and results), 0 (notes too) or 1 (``--verbose``:
    debug records too)."""
    root = logging.getLogger("ray_diloco")
    for h in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(h)
    handler = _Handler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logging.DEBUG if verbosity > 0 else logging.INFO if verbosity == 0 else logging.WARNING
    handler.addFilter(lambda r: r.levelno >= level or getattr(r, "result", False))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbosity > 0 else logging.INFO)
    global _installed
    _installed = verbosity
