"""Pipeline schedules as data: per device, the ordered list of actions it runs in one step.

An action is a forward `F`, a backward `B` (input and weight gradients together, with the
recompute of a re-materializing cell), or the backward split in two: `I`, the input gradient
(what the previous stage waits for), and `W`, the weight gradient (which nothing downstream
waits for, so it can fill a bubble). Each names a stage (a cell of the pipeline) and a
micro-batch. With v virtual stages per device there are S = v K stages, stage s on device s % K
(zero_bubble_v places its two stages per device in a V: stage s on device s for s < K, else on
device 2K - 1 - s).

`Make(kind, K, M, v)` returns a validated `Schedule`; the executor compiles its lists into the
graph, and the simulator and the memory planner walk the same lists, so what is predicted and
drawn is what is built. What each kind implies (the loss inside the pipeline, a split backward,
its placement, the virtual stages it takes, its list-making function) is one `ScheduleKind` in
one table (`Kind(name)`, as PyTorch's `get_schedule_class`), read wherever a kind is acted on
instead of comparing names. The kinds:

  gpipe             fill-drain (GPipe): every forward, then every backward. Bubble
                    (K-1)/(M+K-1); a stage holds all M micro-batches' stored activations.
  1f1b              PipeDream-flush: K-1-k warm-up forwards on device k, then one forward and
                    one backward in turn. The same bubble; at most K-k micro-batches stored.
  interleaved_1f1b  Megatron's interleaved 1F1B: v stages per device, micro-batches in groups
                    of K; bubble (K-1)/(vM+K-1) with a stage's costs 1/v of a device's share.
  zero_bubble       ZB-H1 (Qi et al. 2024): 1F1B with the backward split into I and W and the
                    W passes deferred into the drain bubbles; the same memory limit as 1F1B,
                    about a third of its bubble when F, I and W cost the same.
  zero_bubble_v     ZB-V (Qi et al. 2024): two stages per device in a V (device d runs
                    stages d and 2K-1-d, so the first device also runs the last stage), the
                    backward split into I and W, ordered for the executor's costs (an I
                    of a re-materializing stage re-runs its forward: two forwards, else one;
                    a W one); a device starts a micro-batch only while fewer than 2K await
                    their first stage's W. With those costs it idles less than 1F1B, and
                    for M >= K about half of ZB-H1's idle time without re-materialization
                    and a quarter with it (up to 11% more at a few M near 2K: K=7, M=16).

A validator (`Validate`) rejects lists that miss or repeat an action, put a stage on the wrong
device, or deadlock (a device waiting on an action another device can only run later), naming
the action.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

# How stages are placed on devices: round (stage s on device s % K) or a V (zero_bubble_v).
PLACEMENTS = ('round', 'v')
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


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A validated schedule.

    Attributes:
      kind: one of KINDS, or 'custom' for lists given by hand.
      num_devices: K.
      num_micro_batches: M.
      virtual_stages: v, stages per device (S = v K stages).
      actions: per device, its actions in the order it runs them.
      order: every action once, devices' lists interleaved in an order that respects every
        dependency (`Validate`'s): the order to build the graph in.
      placement: one of PLACEMENTS, how stages sit on devices (`StageDevice`).
    """
    kind: str
    num_devices: int
    num_micro_batches: int
    virtual_stages: int
    actions: tuple
    order: tuple
    placement: str = 'round'

    @property
    def num_stages(self) -> int:
        return self.num_devices * self.virtual_stages

    def DeviceOf(self, stage: int) -> int:
        return StageDevice(stage, self.num_devices, self.placement)

    def Needs(self, action: Action) -> list[Action]:
        """The actions `action` needs the results of, in this schedule: `Dependencies`, the
        backward of the next stage being its I where that stage splits it."""
        return _Needs(action, self.num_stages, self._split)

    @functools.cached_property
    def _split(self) -> frozenset:
        """The (stage, micro-batch) pairs whose backward is split into I and W."""
        return frozenset((a.stage, a.micro_batch) for device in self.actions for a in device
                         if a.kind == INPUT_GRAD)

    @property
    def training(self) -> bool:
        """Whether the schedule has backward actions (a forward-only one has none)."""
        return any(a.kind != FORWARD for device in self.actions for a in device)

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into I and W actions."""
        return any(a.kind == WEIGHT_GRAD for device in self.actions for a in device)

    @property
    def forward_first(self) -> bool:
        """Whether every device runs all its forwards before any backward: then the loss can be
        computed after the pipeline, on the whole batch (else it must be computed per
        micro-batch on the last stage, as soon as the micro-batch's forward is done)."""
        for device in self.actions:
            kinds = [a.kind for a in device]
            if FORWARD in kinds and any(k != FORWARD for k in kinds[:_LastIndex(kinds, FORWARD)]):
                return False
        return True


def Placement(kind: str) -> str:
    """The placement (one of PLACEMENTS) of schedule `kind`'s stages ('round' for a name that
    is no kind: `Make` refuses it, naming it)."""
    found = SCHEDULE_KINDS.get(kind)
    return found.placement if found is not None else 'round'


def StageDevice(stage: int, num_devices: int, placement: str = 'round') -> int:
    """The device of `stage`: s % K ('round'), or in a V ('v', two stages per device: s for
    s < K, else 2K - 1 - s)."""
    if placement == 'v':
        return stage if stage < num_devices else 2 * num_devices - 1 - stage
    return stage % num_devices


def _LastIndex(items: list, value) -> int:
    return len(items) - 1 - items[::-1].index(value)


def _CheckCounts(num_devices: int, num_micro_batches: int, virtual_stages: int) -> None:
    if num_devices < 1 or num_micro_batches < 1 or virtual_stages < 1:
        raise ScheduleError(f'K (devices), M (micro-batches) and v (virtual stages) must be >= 1, '
                            f'got {num_devices}, {num_micro_batches} and {virtual_stages}.')


# ---- the schedules ------------------------------------------------------------------------------
def _GPipe(k_count: int, m_count: int, v: int) -> list[list[Action]]:
    """Fill-drain: each device runs its stages' forwards in stage order per micro-batch, then
    the backwards (the last stage's first)."""
    lists = []
    for d in range(k_count):
        stages = range(d, v * k_count, k_count)
        lists.append([Action(FORWARD, s, m) for s in stages for m in range(m_count)] +
                     [Action(BACKWARD, s, m) for s in reversed(stages) for m in range(m_count)])
    return lists


def _OneFOneB(k_count: int, m_count: int) -> list[list[Action]]:
    lists = []
    for d in range(k_count):
        warm_up = min(k_count - 1 - d, m_count)
        actions = [Action(FORWARD, d, m) for m in range(warm_up)]
        for i in range(m_count - warm_up):
            actions += [Action(FORWARD, d, warm_up + i), Action(BACKWARD, d, i)]
        actions += [Action(BACKWARD, d, m) for m in range(m_count - warm_up, m_count)]
        lists.append(actions)
    return lists


def _Interleaved(k_count: int, m_count: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: micro-batches go through a device's v stages in groups of
    K; device d warms up with 2 (K - 1 - d) + (v - 1) K forwards."""
    if v == 1:
        return _OneFOneB(k_count, m_count)
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


def _ZeroBubbleH1(k_count: int, m_count: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's order of forwards and input gradients (I in place of B), with each weight
    gradient W deferred to where the device would otherwise wait, made by a walk with unit
    costs. A device runs its next F or I when it is ready (an F only while fewer than K
    micro-batches await their W, the first stage's limit under 1F1B), else its oldest pending
    W; the W left at the end fill the drain."""
    main = [[Action(INPUT_GRAD if a.kind == BACKWARD else a.kind, a.stage, a.micro_batch)
             for a in device] for device in _OneFOneB(k_count, m_count)]
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


def _SplitCosts(recomputes) -> Callable[[Action], int]:
    """An action's cost in forwards as the executor runs a split backward: a backward of twice
    the forward split into halves, I and W, and a re-materializing stage's I running its
    forward again first (`looped`, `residuals.SplitCell`); W runs no forward."""
    def Cost(action):
        if action.kind == INPUT_GRAD and recomputes[action.stage]:
            return 2
        return 1
    return Cost


def _ZeroBubbleV(k_count: int, m_count: int, recomputes) -> list[list[Action]]:
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


# ---- the kinds ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """A schedule kind and what it implies, read wherever a kind is acted on.

    Attributes:
      name: the kind's name, as Params (`PipeliningLayer.Params().schedule`) and the trainer's
        --schedule give it.
      summary: one line for help texts.
      make: (K, M, v, recomputes) -> per device, its training action list (what `Make`
        validates); `recomputes` says per stage whether it re-materializes, for a kind that
        orders its actions by what they cost.
      loss_inside_pipeline: whether a device starts backwards before its last forward, so the
        loss must be computed per micro-batch on the last stage as its forward ends
        (`PipeliningLayer.FPropLoss`; tasks do this); else it may follow the pipeline, on the
        whole batch.
      splits_backward: whether backwards are split into I (input gradient) and W (weight
        gradient) actions.
      placement: how stages sit on devices, one of PLACEMENTS (`StageDevice`).
      virtual_stages: the v it takes: None for any, else that one count.
      searched_virtual_stages: the v the tuner (`perf.tuner.Space`) and the benchmarks run it
        with: 2 where several stages per device are the kind's point.
      ideal_bubble: (K, M, v) -> the idle fraction of balanced stages with free transfers and a
        backward twice the forward (`IdealBubble`); None where there is no closed form.
    """
    name: str
    summary: str
    make: Callable[[int, int, int, tuple], list[list[Action]]]
    loss_inside_pipeline: bool
    splits_backward: bool = False
    placement: str = 'round'
    virtual_stages: int | None = 1
    searched_virtual_stages: int = 1
    ideal_bubble: Callable[[int, int, int], float] | None = None

    def CheckVirtualStages(self, virtual_stages: int) -> None:
        """Raises ScheduleError unless this kind takes v = `virtual_stages`."""
        if self.virtual_stages is None or virtual_stages == self.virtual_stages:
            return
        if self.virtual_stages == 1:
            takers = ' or '.join(k.name for k in SCHEDULE_KINDS.values()
                                 if k.virtual_stages is None)
            raise ScheduleError(f'virtual_stages > 1 needs schedule {takers}, got {self.name!r} '
                                f'with virtual_stages={virtual_stages}.')
        count = 'two' if self.virtual_stages == 2 else str(self.virtual_stages)
        where = ', in a V' if self.placement == 'v' else ''
        raise ScheduleError(f'{self.name} runs {count} stages per device{where}: virtual_stages '
                            f'must be {self.virtual_stages}, got {virtual_stages}.')


def _FillDrainBubble(k_count: int, m_count: int, v: int) -> float:
    del v  # A device runs its stages in turn: the bubble of one stage per device.
    return (k_count - 1) / (m_count + k_count - 1)


def _InterleavedBubble(k_count: int, m_count: int, v: int) -> float:
    return (k_count - 1) / (v * m_count + k_count - 1)


# Every kind, in the order help texts and the tuner list them (`KINDS`).
SCHEDULE_KINDS: dict[str, ScheduleKind] = {kind.name: kind for kind in (
    ScheduleKind(
        'gpipe', 'GPipe\'s fill-drain, every forward then every backward, all M micro-batches\' '
        'activations stored', lambda k, m, v, r: _GPipe(k, m, v), loss_inside_pipeline=False,
        virtual_stages=None, ideal_bubble=_FillDrainBubble),
    ScheduleKind(
        '1f1b', 'PipeDream-flush, one forward and one backward in turn, the same bubble with at '
        'most K micro-batches stored', lambda k, m, v, r: _OneFOneB(k, m),
        loss_inside_pipeline=True, ideal_bubble=_FillDrainBubble),
    ScheduleKind(
        'interleaved_1f1b', 'Megatron\'s interleaved 1F1B, virtual_stages cells per device for '
        'a smaller bubble', lambda k, m, v, r: _Interleaved(k, m, v), loss_inside_pipeline=True,
        virtual_stages=None, searched_virtual_stages=2, ideal_bubble=_InterleavedBubble),
    ScheduleKind(
        'zero_bubble', 'ZB-H1, 1f1b with the backward split into input and weight gradients, '
        'the weight gradients filling the drain, about a third of 1f1b\'s bubble',
        lambda k, m, v, r: _ZeroBubbleH1(k, m), loss_inside_pipeline=True, splits_backward=True),
    ScheduleKind(
        'zero_bubble_v', 'ZB-V, virtual_stages=2 cells per device in a V, cell s on device s '
        'for s < K, else on 2K-1-s, the backward split, at M >= K idling about a quarter '
        '(re-materializing) to a half of zero_bubble\'s time',
        lambda k, m, v, r: _ZeroBubbleV(k, m, r), loss_inside_pipeline=True, splits_backward=True,
        placement='v', virtual_stages=2, searched_virtual_stages=2),
)}
KINDS = tuple(SCHEDULE_KINDS)
# The kind Params give unless told (`PipeliningLayer.Params().schedule`): the paper's.
DEFAULT_KIND = 'gpipe'


def Kind(name: str) -> ScheduleKind:
    """The schedule kind called `name`.

    Raises:
      ScheduleError: for a name that is not one of KINDS.
    """
    try:
        return SCHEDULE_KINDS[name]
    except (KeyError, TypeError):
        raise ScheduleError(f'schedule must be one of {KINDS}, got {name!r}.') from None


def KindsHelp() -> str:
    """Every kind with its summary, for help texts."""
    return '; '.join(f'{kind.name} ({kind.summary})' for kind in SCHEDULE_KINDS.values())


def Make(kind: str, num_devices: int, num_micro_batches: int, virtual_stages: int = 1,
         training: bool = True, recomputes: Sequence[bool] | None = None) -> Schedule:
    """The validated schedule `kind` for K devices, M micro-batches and v stages per device.

    Args:
      kind: one of KINDS.
      num_devices, num_micro_batches, virtual_stages: K, M and v (what the kind takes:
        `ScheduleKind.virtual_stages`; gpipe runs a device's stages in turn).
      training: False gives the forward-only schedule (inference): every device runs its
        forwards in the training schedule's order, no backward.
      recomputes: per stage (S = v K of them), whether it re-materializes (recompute mode
        'always': all of them, the default; `plan.RecomputeFlags`). zero_bubble_v orders
        its actions by their costs, which this changes (`_SplitCosts`).

    Raises:
      ScheduleError: for an unknown kind, counts the kind cannot schedule, or `recomputes`
        not of S flags.
    """
    _CheckCounts(num_devices, num_micro_batches, virtual_stages)
    found = Kind(kind)
    found.CheckVirtualStages(virtual_stages)
    num_stages = num_devices * virtual_stages
    recomputes = (True,) * num_stages if recomputes is None else tuple(recomputes)
    if len(recomputes) != num_stages:
        raise ScheduleError(f'recomputes must give one flag per stage, {num_stages} '
                            f'(K={num_devices} x v={virtual_stages}), got {len(recomputes)}.')
    lists = found.make(num_devices, num_micro_batches, virtual_stages, recomputes)
    if not training:
        lists = [[a for a in device if a.kind == FORWARD] for device in lists]
    return FromLists(lists, num_micro_batches, virtual_stages, kind=kind,
                     placement=found.placement)


def FromLists(lists, num_micro_batches: int, virtual_stages: int = 1,
              kind: str = 'custom', placement: str = 'round') -> Schedule:
    """A Schedule of per-device action lists (Actions, or (kind, stage, micro_batch) tuples),
    validated, its stages placed by `placement` (one of PLACEMENTS).

    Raises:
      ScheduleError: naming the first problem (see `Validate`).
    """
    lists = tuple(tuple(Action(*a) for a in device) for device in lists)
    _CheckCounts(len(lists), num_micro_batches, virtual_stages)
    order = Validate(lists, num_micro_batches, virtual_stages, placement)
    return Schedule(kind=kind, num_devices=len(lists), num_micro_batches=num_micro_batches,
                    virtual_stages=virtual_stages, actions=lists, order=tuple(order),
                    placement=placement)


# ---- dependencies and validation ----------------------------------------------------------------
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


def Validate(lists, num_micro_batches: int, virtual_stages: int = 1,
             placement: str = 'round') -> list[Action]:
    """Checks per-device action lists and returns an order to build them in.

    Every (stage, micro-batch) must have one F and, if any backward exists, either one B or
    one I and one W; stage s's actions must be on its device (`StageDevice`: s % K, or in a V
    with placement 'v'); and running each device's list in order must never wait forever.

    Returns:
      Every action once, in an order where each follows its dependencies and each device's
      actions keep their list order.

    Raises:
      ScheduleError: naming the missing, repeated, misplaced or deadlocked action.
    """
    num_devices = len(lists)
    num_stages = num_devices * virtual_stages
    if placement not in PLACEMENTS:
        raise ScheduleError(f'placement must be one of {PLACEMENTS}, got {placement!r}.')
    if placement == 'v' and virtual_stages != 2:
        raise ScheduleError(f'a V places two stages per device: virtual_stages must be 2, got '
                            f'{virtual_stages}.')

    def DeviceOf(stage):
        return StageDevice(stage, num_devices, placement)

    seen = {}
    for d, device in enumerate(lists):
        for a in device:
            if a.kind not in ACTION_KINDS:
                raise ScheduleError(f'device {d}: {a} has an unknown kind; expected one of '
                                    f'{ACTION_KINDS}.')
            if not (0 <= a.stage < num_stages and 0 <= a.micro_batch < num_micro_batches):
                raise ScheduleError(f'device {d}: {a} is out of range: {num_stages} stages, '
                                    f'{num_micro_batches} micro-batches.')
            if DeviceOf(a.stage) != d:
                raise ScheduleError(f'{a} is on device {d}; stage {a.stage} runs on device '
                                    f'{DeviceOf(a.stage)}.')
            if a in seen:
                raise ScheduleError(f'{a} appears twice (devices {seen[a]} and {d}).')
            seen[a] = d
    has_backward = any(a.kind != FORWARD for a in seen)
    split = set()
    if has_backward:
        split = [(s, m) for s in range(num_stages) for m in range(num_micro_batches)
                 if Action(INPUT_GRAD, s, m) in seen or Action(WEIGHT_GRAD, s, m) in seen]
        for s, m in split:
            for kind in (INPUT_GRAD, WEIGHT_GRAD):
                if Action(kind, s, m) not in seen:
                    raise ScheduleError(f'{Action(kind, s, m)} is missing: stage {s} splits its '
                                        f'backward of micro-batch {m} into I and W.')
            if Action(BACKWARD, s, m) in seen:
                raise ScheduleError(f'{Action(BACKWARD, s, m)} repeats the I and W of the same '
                                    'micro-batch.')
        split = set(split)
    for s in range(num_stages):
        for m in range(num_micro_batches):
            if Action(FORWARD, s, m) not in seen:
                raise ScheduleError(f'{Action(FORWARD, s, m)} is missing from device '
                                    f'{DeviceOf(s)}.')
            if has_backward and (s, m) not in split and Action(BACKWARD, s, m) not in seen:
                raise ScheduleError(f'{Action(BACKWARD, s, m)} is missing from device '
                                    f'{DeviceOf(s)}.')

    def Needs(a):
        return _Needs(a, num_stages, split)

    position = [0] * num_devices
    done = set()
    order = []
    while len(order) < len(seen):
        progressed = False
        for d in range(num_devices):
            while position[d] < len(lists[d]):
                a = lists[d][position[d]]
                if not all(dep in done for dep in Needs(a)):
                    break
                done.add(a)
                order.append(a)
                position[d] += 1
                progressed = True
        if not progressed:
            waits = []
            for d in range(num_devices):
                if position[d] < len(lists[d]):
                    a = lists[d][position[d]]
                    missing = [dep for dep in Needs(a) if dep not in done]
                    waits.append(f'device {d} waits at {a} for '
                                 f'{", ".join(str(x) for x in missing)}')
            raise ScheduleError('the schedule deadlocks: ' + '; '.join(waits) + '.')
    return order


# ---- what a schedule implies --------------------------------------------------------------------
def StoredMicroBatches(sched: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose forward has run and whose backward has not
    finished (their stored activations, or inputs when re-materializing, alive at once), going
    through the stage's device's list in order. A split backward frees at its W."""
    peaks = [0] * sched.num_stages
    alive = [0] * sched.num_stages
    for device in sched.actions:
        for a in device:
            if a.kind == FORWARD:
                alive[a.stage] += 1
                peaks[a.stage] = max(peaks[a.stage], alive[a.stage])
            elif a.kind in (BACKWARD, WEIGHT_GRAD):
                alive[a.stage] -= 1
    return peaks


def IdealBubble(kind: str, num_devices: int, num_micro_batches: int,
                virtual_stages: int = 1) -> float:
    """The idle fraction of a device's step time with balanced stages, free transfers and a
    backward twice the forward: (K-1)/(M+K-1) for gpipe and 1f1b, (K-1)/(vM+K-1) interleaved.
    zero_bubble and zero_bubble_v have no closed form here (see `perf.simulator`).

    Raises:
      ScheduleError: for a kind without a closed form (`ScheduleKind.ideal_bubble`), or counts
        below 1.
    """
    _CheckCounts(num_devices, num_micro_batches, virtual_stages)
    found = SCHEDULE_KINDS.get(kind)
    if found is None or found.ideal_bubble is None:
        raise ScheduleError(f'no closed-form bubble for schedule {kind!r}; simulate it.')
    return found.ideal_bubble(num_devices, num_micro_batches, virtual_stages)


def BubbleFraction(num_micro_batches: int, num_cells: int) -> float:
    """GPipe's idle fraction: (K - 1) / (M + K - 1)."""
    return IdealBubble('gpipe', num_cells, num_micro_batches)


def _Needs(action: Action, num_stages: int, split) -> list[Action]:
    """`Dependencies`, with the next stage's backward an I where (stage + 1, micro-batch) is in
    `split`, else a B."""
    following = (action.stage + 1, action.micro_batch) in split
    return Dependencies(action, num_stages, INPUT_GRAD if following else BACKWARD)
