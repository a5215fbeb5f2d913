"""Mistakes a user can fix end as one line on stderr; bugs keep their traceback.

    error: <what>, <where>, <how to fix> (traceback: <run_dir>/logs/error_<...>.log)

`UserError` is the base of every error whose message is meant for the user (bad data, config,
files, services, environment); `UsageError` is its exit-code-2 kind (command line and config). Any
other exception is a bug: its traceback is shown. The full traceback is always written to a log
file (the run's `logs/` once the run directory is known), and `ALIGNER_DEBUG=1` shows it on the
terminal too. A launched rank hands its one line to the launcher through `$ALIGNER_ERROR_FILE`, so
that the launcher prints the first failing rank's message once.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

EXIT_USAGE, EXIT_FAILURE = 2, 1
_log_dir: Path | None = None  # where tracebacks go once the run directory is known


class UserError(Exception):
    """A mistake the user can fix. `what`, `where` (file:line, key, URL) and `fix` make the line;
    a subclass may set a default `fix`."""

    exit_code = EXIT_FAILURE
    fix = ""
    # the process ends as soon as the error is reported (`handle`), without the interpreter's teardown: for a
    # failure that leaves objects whose destructors can block, such as a process group with sends queued to a
    # peer that is gone (generation/workers.py)
    end_process = False

    def __init__(self, what: str, where: str = "", fix: str = ""):
        super().__init__(what)
        self.what, self.where = what, where
        if fix:
            self.fix = fix

    def __str__(self) -> str:
        return ", ".join(part for part in (self.what, self.where, self.fix) if part)


class UsageError(UserError):
    """The command line or the config cannot run (exit code 2)."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError, ValueError):
    """A config that cannot run: unknown key, wrong type, missing value or conflicting values."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are one `error:` line (exit code 2), like every other usage error."""

    def error(self, message: str):
        raise UsageError(message, self.prog, f"see `{self.prog} --help`")


class ReportedFailure(Exception):
    """A failure whose message is already what the user should see (a launched rank's report):
    printed as it is, with its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE):
        super().__init__(message)
        self.exit_code = exit_code


def set_log_dir(path: str | Path) -> None:
    global _log_dir
    _log_dir = Path(path)


def debug() -> bool:
    return os.environ.get("ALIGNER_DEBUG", "") not in ("", "0")


def write_traceback(error: BaseException) -> Path:
    """The traceback in `<run_dir>/logs/` (or the temp dir before a run directory exists)."""
    text = "".join(traceback.format_exception(error))
    rank = os.environ.get("RANK", "0")
    name = f"error_{time.strftime('%Y%m%d-%H%M%S')}_rank{rank}_{os.getpid()}.log"
    env_dir = os.environ.get("ALIGNER_LOG_DIR")
    for directory in (_log_dir, Path(env_dir) if env_dir else None, Path(tempfile.gettempdir())):
        if directory is None:
            continue
        try:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / name).write_text(text)
            return directory / name
        except OSError:
            continue
    return Path(os.devnull)


def user_line(error: UserError, traceback_path: Path) -> str:
    return f"error: {error} (traceback: {traceback_path})"


def handle(error: BaseException) -> int:
    """Report `error` the way its kind asks and return the exit code (or end the process with it, for a
    `UserError.end_process`). In a launched rank (`$ALIGNER_ERROR_FILE` set) nothing is printed: the launcher
    reports the first failing rank."""
    code = _report(error)
    if getattr(error, "end_process", False):
        end_process(code)
    return code


def end_process(code: int) -> None:
    """Exit now with `code`, the standard streams and logs flushed, skipping the interpreter's teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _report(error: BaseException) -> int:
    if isinstance(error, ReportedFailure):
        print(error, file=sys.stderr, flush=True)
        return error.exit_code
    path = write_traceback(error)
    is_user = isinstance(error, UserError)
    code = error.exit_code if is_user else EXIT_FAILURE
    line = user_line(error, path) if is_user else "".join(traceback.format_exception(error)).rstrip()
    error_file = os.environ.get("ALIGNER_ERROR_FILE")
    if error_file:
        Path(error_file).write_text(json.dumps({"user": is_user, "exit_code": code, "message": line,
                                                "traceback": str(path)}))
        if debug():
            print("".join(traceback.format_exception(error)), file=sys.stderr, flush=True)
        return code
    if is_user and debug():
        print("".join(traceback.format_exception(error)), file=sys.stderr, end="")
    print(line, file=sys.stderr, flush=True)
    return code


def read_rank_error(error_file: Path) -> dict | None:
    """What a failed rank left in its error file: {"user", "exit_code", "message", "traceback"}."""
    try:
        return json.loads(error_file.read_text())
    except (OSError, ValueError):
        return None
