"""Reading an input's text file (a corpus, a vocabulary) as lines, what goes wrong as one
InputError naming the file and what it must be."""

from __future__ import annotations

from gpipe_tf import errors


def ReadLines(path: str, expected: str) -> list[str]:
    """The lines of UTF-8 text file `path`, split at '\\n' only (a final '' where it ends in
    one; '\\r' is left to the caller).

    Args:
      path: a local file.
      expected: what the file must be, for the message ('a UTF-8 TSV file of sentence pairs').

    Raises:
      errors.InputError (a ValueError): when `path` cannot be read (a directory, no permission)
        or is not UTF-8.
    """
    try:
        with open(path, encoding='utf-8', newline='') as f:
            return f.read().split('\n')
    except UnicodeDecodeError as e:
        raise errors.InputError(f'{path}: not UTF-8 text ({e}); expected {expected}.') from e
    except OSError as e:
        raise errors.InputError(f'{path}: cannot read it ({e.strerror or e}); expected '
                                f'{expected}.') from e
