"""What a resumed run changed in the pipeline's partition, in one line.

A checkpoint restores at any K, M, R and partition (layers are keyed by name, randomness is
drawn per layer and example), so a run may be resumed under another partition; the resume line
says what changed (`partition changed: K 4 -> 2`), read from the logdir's `params.txt` (the
previous start's Params) and the Params of this start.
"""

from __future__ import annotations

# Params of the pipeline (`model.*`) that partition the run, and how the resume line names them.
# The devices are left out: the trainer sets them from K and R, which the line names.
_FIELDS = (('num_cells', 'K'), ('num_micro_batches', 'M'), ('micro_batch_size', 'micro_batch_size'),
           ('num_replicas', 'R'), ('partition_method', 'partition_method'),
           ('recompute', 'recompute'))


def _Values(params_text: str) -> dict[str, str]:
    """`model.<field>` values of a Params text (`key : value` lines), as text."""
    values = {}
    for line in params_text.splitlines():
        key, sep, value = line.partition(' : ')
        if sep and key.startswith('model.'):
            values[key[len('model.'):]] = value.strip()
    return values


def Describe(old_text: str | None, new_text: str) -> str:
    """'partition changed: K 4 -> 2, M 8 -> 4', or '' when nothing of the partition changed (or
    there is no previous Params text)."""
    if not old_text:
        return ''
    old, new = _Values(old_text), _Values(new_text)
    changes = [f'{label} {old[field]} -> {new[field]}' for field, label in _FIELDS
               if field in old and field in new and old[field] != new[field]]
    return f'partition changed: {", ".join(changes)}' if changes else ''
