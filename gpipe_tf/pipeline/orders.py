"""How each schedule kind orders its actions: per device, the list it runs in one step.

Fill-drain, 1F1B and interleaved 1F1B are closed forms; ZB-H1 and ZB-V are made by walks that
start, at each time step, the first ready action of a device's preference (`schedule` names
the kinds and validates what these return).
"""

from __future__ import annotations

from typing import Callable, Sequence

from gpipe_tf.pipeline.actions import (BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action,
                                       Dependencies, ScheduleError)


def FillDrain(k_count: int, m_count: int, v: int) -> list[list[Action]]:
    """Fill-drain: each device runs its stages' forwards in stage order per micro-batch, then
    the backwards (the last stage's first)."""
    lists = []
    for d in range(k_count):
        stages = range(d, v * k_count, k_count)
        lists.append([Action(FORWARD, s, m) for s in stages for m in range(m_count)] +
                     [Action(BACKWARD, s, m) for s in reversed(stages) for m in range(m_count)])
    return lists


def OneFOneB(k_count: int, m_count: int) -> list[list[Action]]:
    """PipeDream-flush: device d warms up with K-1-d forwards, then runs one forward and one
    backward in turn, then the backwards left."""
    lists = []
    for d in range(k_count):
        warm_up = min(k_count - 1 - d, m_count)
        actions = [Action(FORWARD, d, m) for m in range(warm_up)]
        for i in range(m_count - warm_up):
            actions += [Action(FORWARD, d, warm_up + i), Action(BACKWARD, d, i)]
        actions += [Action(BACKWARD, d, m) for m in range(m_count - warm_up, m_count)]
        lists.append(actions)
    return lists


def Interleaved(k_count: int, m_count: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: micro-batches go through a device's v stages in groups of
    K; device d warms up with 2 (K - 1 - d) + (v - 1) K forwards."""
    if v == 1:
        return OneFOneB(k_count, m_count)
    if m_count % k_count:
        raise ScheduleError(f'interleaved_1f1b sends micro-batches round in groups of K: M '
                            f'({m_count}) must be a multiple of K ({k_count}).')
    total = m_count * v

    def Chunk(i, backward):
        chunk = (i // k_count) % v
        return (v - 1 - chunk if backward else chunk), (i // (k_count * v)) * k_count + i % k_count

    lists = []
    for d in range(k_count):
        def Make(kind, i):
            chunk, m = Chunk(i, kind == BACKWARD)
            return Action(kind, chunk * k_count + d, m)

        warm_up = min(2 * (k_count - 1 - d) + (v - 1) * k_count, total)
        actions = [Make(FORWARD, i) for i in range(warm_up)]
        for i in range(total - warm_up):
            actions += [Make(FORWARD, warm_up + i), Make(BACKWARD, i)]
        actions += [Make(BACKWARD, i) for i in range(total - warm_up, total)]
        lists.append(actions)
    return lists


def ZeroBubbleH1(k_count: int, m_count: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's order of forwards and input gradients (I in place of B), with each weight
    gradient W deferred to where the device would otherwise wait, made by a walk with unit
    costs. A device runs its next F or I when it is ready (an F only while fewer than K
    micro-batches await their W, the first stage's limit under 1F1B), else its oldest pending
    W; the W left at the end fill the drain."""
    main = [[Action(INPUT_GRAD if a.kind == BACKWARD else a.kind, a.stage, a.micro_batch)
             for a in device] for device in OneFOneB(k_count, m_count)]
    done_at = {}  # Action -> the time step it finishes.
    lists = [[] for _ in range(k_count)]
    position = [0] * k_count
    pending = [[] for _ in range(k_count)]  # Per device, W actions not yet run, oldest first.
    time = 0
    while any(len(a) < 3 * m_count for a in lists):
        started = []
        for d in range(k_count):
            if lists[d] and done_at[lists[d][-1]] > time:
                continue  # Busy.
            action = main[d][position[d]] if position[d] < m_count * 2 else None
            awaiting_w = sum(1 for a in lists[d] if a.kind == FORWARD) - sum(
                1 for a in lists[d] if a.kind == WEIGHT_GRAD)
            if action is not None and (not _Ready(action, k_count, done_at, time) or (
                    action.kind == FORWARD and awaiting_w >= k_count)):
                action = None
            if action is None and pending[d]:
                action = pending[d][0]
            if action is not None:
                started.append((d, action))
        for d, action in started:
            lists[d].append(action)
            done_at[action] = time + 1
            if action.kind == WEIGHT_GRAD:
                pending[d].pop(0)
            else:
                position[d] += 1
                if action.kind == INPUT_GRAD:
                    pending[d].append(Action(WEIGHT_GRAD, d, action.micro_batch))
        time += 1
    return lists


def _SplitCosts(recomputes: Sequence[bool]) -> Callable[[Action], int]:
    """An action's cost in forwards as the executor runs a split backward: a backward of twice
    the forward split into halves, I and W, and a re-materializing stage's I running its
    forward again first (`looped`, `cell.CellSplit`); W runs no forward."""
    def Cost(action):
        if action.kind == INPUT_GRAD and recomputes[action.stage]:
            return 2
        return 1
    return Cost


def ZeroBubbleV(k_count: int, m_count: int, recomputes: Sequence[bool]) -> list[list[Action]]:
    """ZB-V's lists, made by a walk with the executor's costs (`_SplitCosts`: per stage,
    `recomputes` says whether it re-materializes): device d runs stages d (the V's first arm)
    and 2K-1-d (its second). When free, a device runs the first that is ready of: an I (the
    oldest micro-batch's; of the earlier stage on a tie), a forward of its second-arm stage, a
    forward of its first-arm stage while fewer than 2K micro-batches await that stage's W,
    else its oldest pending W. (A list made for one mode's costs idles more under the other's:
    at K=8, M=32 the list made for re-materializing stages idles 4.5% of the step without
    re-materialization, where the one made for that idles 3.5%, and 27% with it.)"""
    num_stages = 2 * k_count
    cost = _SplitCosts(recomputes)
    limit = 2 * k_count
    done_at = {}  # Action -> the time step it finishes.
    lists = [[] for _ in range(k_count)]
    next_m = {(kind, s): 0 for kind in (FORWARD, INPUT_GRAD) for s in range(num_stages)}
    pending = [[] for _ in range(k_count)]  # Per device, W actions not yet run, oldest first.
    time = 0

    def Next(kind, s):
        """Stage s's next action of `kind` if it can start at `time`, else None."""
        m = next_m[kind, s]
        action = Action(kind, s, m) if m < m_count else None
        return action if action and _Ready(action, num_stages, done_at, time) else None

    while any(len(a) < 6 * m_count for a in lists):
        started = []
        for d in range(k_count):
            if lists[d] and done_at[lists[d][-1]] > time:
                continue  # Busy.
            first, second = d, num_stages - 1 - d
            backwards = [a for a in (Next(INPUT_GRAD, first), Next(INPUT_GRAD, second)) if a]
            candidates = sorted(backwards, key=lambda a: (a.micro_batch, a.stage))
            candidates.append(Next(FORWARD, second))
            awaiting_w = next_m[FORWARD, first] - sum(
                1 for a in lists[d] if a.kind == WEIGHT_GRAD and a.stage == first)
            if awaiting_w < limit:
                candidates.append(Next(FORWARD, first))
            candidates += pending[d][:1]
            action = next((a for a in candidates if a), None)
            if action is not None:
                started.append((d, action))
        if not started and all(not lists[d] or done_at[lists[d][-1]] <= time
                               for d in range(k_count)):
            raise RuntimeError(f'zero_bubble_v: no device can start at time {time} '
                               f'(K={k_count}, M={m_count}).')  # A bug of ours.
        for d, action in started:
            lists[d].append(action)
            done_at[action] = time + cost(action)
            if action.kind == WEIGHT_GRAD:
                pending[d].remove(action)
            else:
                next_m[action.kind, action.stage] += 1
                if action.kind == INPUT_GRAD:
                    pending[d].append(Action(WEIGHT_GRAD, action.stage, action.micro_batch))
        time += 1
    return lists


def _Ready(action: Action, num_stages: int, done_at: dict, time: int) -> bool:
    return all(done_at.get(dep, time + 1) <= time
               for dep in Dependencies(action, num_stages, backward_kind=INPUT_GRAD))
