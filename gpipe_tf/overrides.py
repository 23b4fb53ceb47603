"""Params overrides from the command line or a file, typed by the values they replace.

`Params.FromText` takes any literal for any key; a command line that sets a learning rate to
`"0.1"` (a string) or a step count to `1.5` is a mistake the user wants to hear about before a
run starts, so `Apply` compares each overridden value's kind with the one it replaces.
"""

from __future__ import annotations

from gpipe_tf import errors


def _Kind(value) -> str:
    if isinstance(value, bool):
        return 'bool'
    if isinstance(value, (int, float)):
        return 'number'
    if isinstance(value, str):
        return 'str'
    return 'other'


def Apply(p, text: str, source: str):
    """Applies Params `text` to `p`; a value of another kind than the one it replaces (a string
    for a number, a number for a bool, a float for an int) is a ValueError naming the key."""
    before = p.Copy()
    try:
        p.FromText(text)
    except (ValueError, AttributeError) as e:
        raise errors.ConfigError(f'{source}: {e}') from None
    for line in text.splitlines():
        key = line.split(' : ', 1)[0].strip()
        if not key or key.startswith('#') or ' : ' not in line:
            continue
        try:
            old = before.Get(key)
        except (AttributeError, KeyError, IndexError, ValueError):
            continue  # A new list entry or field that FromText created.
        new = p.Get(key)
        if old is None or new is None or _Kind(old) == 'other' or p.CheckOf(key) is not None:
            continue  # A param with a check of its own: setting it checked the value.
        if _Kind(old) != _Kind(new) or (isinstance(old, int) and not isinstance(old, bool) and
                                         isinstance(new, float)):
            raise errors.ConfigError(
                f'{source}: {key} is {old!r} ({type(old).__name__}); the override gives '
                f'{new!r} ({type(new).__name__}).')
    return p

