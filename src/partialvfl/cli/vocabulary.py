"""One vocabulary for every command: old spellings of renamed options, the task groups of ``--help``, a closed pipe.

* An old spelling keeps working for one release and says on stderr which spelling replaces it
  (:func:`add_old_spelling`; :data:`RENAMED` lists them all, for the docs and the tests).
* ``partialvfl --help`` lists the commands by task (:data:`COMMAND_GROUPS`), not in the order they were added.
* Output into a pipe whose reader has gone (``partialvfl evaluate ... | head -1``) ends quietly with the status a
  shell gives a POSIX tool killed by ``SIGPIPE``: :data:`CLOSED_PIPE_STATUS`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CLOSED_PIPE_STATUS", "COMMAND_GROUPS", "RENAMED", "GroupedHelpParser", "OldSpelling", "add_old_spelling",
           "quiet_closed_pipe", "warn_old_spelling"]

#: 128 + SIGPIPE: what ``yes | head -1`` reports for ``yes`` under ``set -o pipefail``
CLOSED_PIPE_STATUS = 141

#: old spelling -> new spelling, per command (each old one still works and warns)
RENAMED: dict[str, dict[str, str]] = {
    "fit, evaluate, predict, explain, value, calibrate, serve": {"--id COLUMN": "--id-column COLUMN"},
    "evaluate": {"--party INDEX": "--party NAME"},
    "serve": {"--deadline-ms MS": "--deadline SECONDS", "--min-round-ms MS": "--min-round SECONDS",
              "--batch-window-ms MS": "--batch-window SECONDS"},
    "certs init": {"--hmac-key": "--write-hmac-key", "--no-hmac-key": "nothing (the default writes no hmac.key)"},
}

#: the commands of ``partialvfl --help``, by task
COMMAND_GROUPS: dict[str, tuple[str, ...]] = {
    "data": ("datasets", "describe", "methods", "mechanisms"),
    "train and evaluate": ("fit", "evaluate", "predict", "explain", "value", "calibrate"),
    "deploy across institutions": ("certs", "party"),
    "serve predictions": ("serve",),
    "benchmark": ("bench", "report"),
}


def warn_old_spelling(old: str, new: str) -> None:
    """Say on stderr that ``old`` is an old spelling that still works for now, and which spelling replaces it."""
    print(f"warning: {old} is deprecated and will be removed in the next release; write {new}", file=sys.stderr)


class OldSpelling(argparse.Action):
    """An old spelling of an option: sets the new option's value (converted if it was given in other units) and warns.

    Hidden from ``--help``; ``new`` is the spelling the warning recommends.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str,
                 convert: Callable[[Any], Any] | None = None, **kwargs: Any) -> None:
        self.new = new
        self.convert = convert
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        """Warn that the old spelling was used, then set the new option's value."""
        warn_old_spelling(option_string or self.option_strings[0], self.new)
        value = self.const if self.nargs == 0 else values
        setattr(namespace, self.dest, self.convert(value) if self.convert is not None else value)


def add_old_spelling(p: Any, old: str, *, dest: str, new: str, flag: bool = False, const: Any = True,
                     convert: Callable[[Any], Any] | None = None, type: Callable[[str], Any] | None = None) -> None:
    """Add ``old`` to parser or group ``p`` as a hidden :class:`OldSpelling` of ``new`` that sets ``dest``.

    ``flag``: the old spelling takes no value (it sets ``dest`` to ``const``).
    """
    if flag:
        p.add_argument(old, action=OldSpelling, dest=dest, new=new, nargs=0, const=const)
    else:
        p.add_argument(old, action=OldSpelling, dest=dest, new=new, convert=convert, type=type)


class GroupedHelpParser(argparse.ArgumentParser):
    """The top-level parser: its ``--help`` lists the commands under the task headings of :data:`COMMAND_GROUPS`."""

    def format_help(self) -> str:
        """Usage, description, the commands by task, then the options."""
        sub = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction))
        helps = {c.dest: c.help or "" for c in sub._choices_actions}
        aliases = {name: p for name, p in sub.choices.items()}
        grouped = [c for cs in COMMAND_GROUPS.values() for c in cs]
        missing = sorted(set(helps) - set(grouped))
        if missing:  # a command added without a group still shows, under "other"
            groups = {**COMMAND_GROUPS, "other": tuple(missing)}
        else:
            groups = COMMAND_GROUPS
        width = max(len(c) for c in helps) + 2
        lines = [self.format_usage().rstrip(), "", self.description or "", ""]
        for title, commands in groups.items():
            lines.append(f"{title}:")
            for c in commands:
                other = [n for n, p in aliases.items() if p is aliases[c] and n != c]
                also = f" (also: {', '.join(other)})" if other else ""
                lines.append(f"  {c.ljust(width)}{helps.get(c, '')}{also}")
            lines.append("")
        lines += ["options:", "  -h, --help  show this help message and exit", "",
                  "Run 'partialvfl COMMAND --help' for a command's options."]
        return "\n".join(lines) + "\n"


def quiet_closed_pipe() -> int:
    """After a ``BrokenPipeError`` on stdout: point stdout at /dev/null (so the interpreter's last flush is silent)
    and return :data:`CLOSED_PIPE_STATUS`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file descriptor (captured): nothing will be flushed to the pipe
        pass
    return CLOSED_PIPE_STATUS
