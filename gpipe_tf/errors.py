"""Errors that are the user's to resolve, not bugs of ours.

The trainer prints such an error as one line on stderr (`error: <message>`) and exits with
status 2 (an EnvironmentFault: 1); anything else that escapes is a bug and keeps its
traceback. The message alone must say what was wrong, the values seen, and what to do
instead.
"""

import re
import sys


class UserError(Exception):
    """A mistake or a state only the user can resolve (a logdir in use, no checkpoint that
    restores, an unsafe directory)."""


class ConfigError(UserError, ValueError):
    """Params, flags or devices that cannot run. A ValueError too, so library callers that
    catch ValueError for bad configuration keep working."""


class InputError(UserError, ValueError):
    """An input the user gave (a file to decode, a data file) is not what it must be: the message
    names the file and what was expected. A ValueError too, as ConfigError."""


class MissingInputError(InputError, FileNotFoundError):
    """A file or directory the input names does not exist (or a pattern matches nothing). A
    FileNotFoundError too, for library callers that catch it."""


class EnvironmentFault(Exception):
    """The machine failed the run, not the user's input (a full disk while a checkpoint is
    written): the trainer prints it as one line and exits with status 1; the message says what
    was kept and how to go on."""



def Warn(text: str) -> None:
    """A one-line warning for the user, on stderr: what happened and what was done about it."""
    print(f'warning: {text}', file=sys.stderr, flush=True)


def Reason(error: BaseException, path: str | None = None) -> str:
    """The first line of an error's message that says something, without TensorFlow's
    decorations ('{{function_node ...}}' before it, '[Op:...]' after it); an OSError's
    strerror; '' if none. With `path`, which the caller's message names already, without the
    path it starts with ('/x/params.txt; Is a directory' -> 'Is a directory')."""
    if isinstance(error, OSError) and error.strerror:
        line = error.strerror
    else:
        lines = [l.strip() for l in str(getattr(error, 'message', error)).splitlines()
                 if any(c.isalpha() for c in l) and not l.startswith('Graph execution error')]
        if not lines:
            return ''
        line = re.sub(r'^\{\{[^}]*\}\}\s*', '', lines[0])
        line = re.sub(r'\s*\[Op:[^\]]*\].*$', '', line)
    if path and line.startswith(path):
        line = line[len(path):].lstrip(';: ')
    return line


def Excerpt(text: str, limit: int = 80) -> str:
    """`text` quoted for an error message, cut to its first `limit` characters (then '...'): a
    huge input line does not make a huge message."""
    return f'{text[:limit]!r}...' if len(text) > limit else repr(text)
