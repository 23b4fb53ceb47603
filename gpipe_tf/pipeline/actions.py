"""The actions of a pipeline schedule, and what each needs.

An action is a forward `F`, a backward `B` (input and weight gradients together, with the
recompute of a re-materializing cell), or the backward split in two: `I`, the input gradient
(what the previous stage waits for), and `W`, the weight gradient (which nothing downstream
waits for). Each names a stage (a cell of the pipeline) and a micro-batch.
"""

from __future__ import annotations

from typing import NamedTuple

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 'F', 'B', 'I', 'W'
ACTION_KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


class ScheduleError(ValueError):
    """A schedule that cannot run: a bad (K, M, v) for its kind, or an invalid action list."""


class Action(NamedTuple):
    """One piece of work: `kind` (F, B, I or W) of `stage` on `micro_batch`."""
    kind: str
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        return f'{self.kind}(stage {self.stage}, micro-batch {self.micro_batch})'



def Dependencies(action: Action, num_stages: int, backward_kind: str = BACKWARD) -> list[Action]:
    """The actions `action` needs the results of.

    F(s, m) needs F(s-1, m); a backward B or I of (s, m) needs F(s, m) and the backward of
    (s+1, m) (whose kind is `backward_kind`, B or I: the one that produces the input gradient);
    W(s, m) needs I(s, m).
    """
    kind, s, m = action
    if kind == FORWARD:
        return [Action(FORWARD, s - 1, m)] if s else []
    if kind == WEIGHT_GRAD:
        return [Action(INPUT_GRAD, s, m)]
    deps = [Action(FORWARD, s, m)]
    if s + 1 < num_stages:
        deps.append(Action(backward_kind, s + 1, m))
    return deps
