"""decoderlab.cli.run_command: how every command ends on a user's mistake."""

import pytest

from decoderlab.cli import UsageError, UserError, run_command


def finish(main, argv):
    with pytest.raises(SystemExit) as ended:
        run_command(main, argv)
    return ended.value.code


def test_usage_error_is_one_line_and_status_2(capsys):
    """A flag's mistake: exactly one ``error:`` line on stderr, no traceback, status 2 (argparse's)."""

    def main(argv):
        raise UsageError("--block_size 0: give at least 2.")

    assert finish(main, []) == 2
    err = capsys.readouterr().err
    assert err == "error: --block_size 0: give at least 2.\n"


@pytest.mark.parametrize("error", [ValueError("bad value"), FileNotFoundError("no such file: x"), UserError("taken")])
def test_expected_errors_are_one_line_and_status_1(capsys, error):
    """A bad value, a missing file, a refused folder: one line, status 1."""

    def main(argv):
        raise error

    assert finish(main, []) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err


def test_debug_shows_the_traceback_and_is_not_passed_on(capsys):
    """``--debug`` is taken out of the arguments and makes the traceback visible."""
    seen = []

    def main(argv):
        seen.append(argv)
        raise ValueError("bad value")

    assert finish(main, ["--x", "1", "--debug"]) == 1
    assert seen == [["--x", "1"]]
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback():
    """What no user input causes (a bug) is not hidden behind one line."""

    def main(argv):
        raise KeyError("internal")

    with pytest.raises(KeyError):
        run_command(main, [])


def test_status_of_main_is_the_exit_status():
    assert finish(lambda argv: 3, []) == 3
    assert finish(lambda argv: None, []) == 0
