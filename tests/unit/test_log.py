"""The package logs through ``logging`` (``ray_diloco.log``): the command line's handler prints a
command's results on stdout and everything else on stderr, message alone; ``--quiet`` keeps
warnings and results, ``--verbose`` adds debug records; an exception's first line has one helper."""

from __future__ import annotations

import logging

import pytest

from ray_diloco.log import RESULT, error_line, setup


@pytest.mark.parametrize("verbosity, shown", [(-1, ["warn"]), (0, ["info", "warn"]), (1, ["debug", "info", "warn"])])
def test_the_command_lines_handler_routes_results_to_stdout_and_filters_by_verbosity(capsys, verbosity, shown):
    log = logging.getLogger("ray_diloco.some.module")
    try:
        setup(verbosity)
        setup(verbosity)  # installed again (each command): one handler, no line printed twice
        log.debug("debug")
        log.info("info")
        log.warning("warn")
        log.info("final validation loss of the global model: 1.2345", extra=RESULT)
        out, err = capsys.readouterr()
        assert out.splitlines() == ["final validation loss of the global model: 1.2345"]  # results, even --quiet
        assert err.splitlines() == shown
    finally:
        root = logging.getLogger("ray_diloco")
        for h in list(root.handlers):
            root.removeHandler(h)
        root.setLevel(logging.NOTSET)


def test_error_line_is_the_type_and_the_first_line_or_the_first_line_alone():
    assert error_line(ValueError("bad value\nmore detail")) == "ValueError: bad value"
    assert error_line(OSError()) == "OSError"
    assert error_line(KeyError("x" * 50), limit=5) == "KeyError: 'xxxx"
    assert error_line(ValueError("first\nsecond"), typed=False) == "first"
    assert error_line(ValueError(""), typed=False) == "ValueError"


def test_every_command_takes_quiet_and_verbose_and_quiet_keeps_the_result():
    from helpers import run_main

    out = run_main(["config", "--quiet", "--set", "diloco.H=7"])
    assert out.returncode == 0 and "H: 7" in out.stdout and out.stderr == ""
    both = run_main(["plan", "--quiet", "--verbose"])
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
