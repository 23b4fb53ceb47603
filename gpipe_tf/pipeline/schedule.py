"""Pipeline schedules as data: per device, the ordered list of actions it runs in one step.

An action (`actions.Action`) is a forward `F`, a backward `B`, or the backward split in two:
`I`, the input gradient, and `W`, the weight gradient (which nothing downstream waits for, so
it can fill a bubble), of a stage (a cell of the pipeline) on a micro-batch. Each kind's lists
come from `orders`. With v virtual stages per device there are S = v K stages, stage s on
device s % K (zero_bubble_v places its two stages per device in a V: stage s on device s for
s < K, else on device 2K - 1 - s).

`Make(kind, K, M, v)` returns a validated `Schedule`; the executor compiles its lists into the
graph, and the simulator and the memory planner walk the same lists, so what is predicted and
drawn is what is built. What each kind implies (the loss inside the pipeline, a split backward,
its placement, the virtual stages it takes, its function in `orders`) is one `ScheduleKind` in
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
from typing import Callable, Sequence

from gpipe_tf.pipeline import orders
from gpipe_tf.pipeline.actions import (  # Also read from here by a schedule's users.
    ACTION_KINDS, BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Dependencies, ScheduleError)

# How stages are placed on devices: round (stage s on device s % K) or a V (zero_bubble_v).
PLACEMENTS = ('round', 'v')


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
        'activations stored', lambda k, m, v, r: orders.FillDrain(k, m, v),
        loss_inside_pipeline=False, virtual_stages=None, ideal_bubble=_FillDrainBubble),
    ScheduleKind(
        '1f1b', 'PipeDream-flush, one forward and one backward in turn, the same bubble with at '
        'most K micro-batches stored', lambda k, m, v, r: orders.OneFOneB(k, m),
        loss_inside_pipeline=True, ideal_bubble=_FillDrainBubble),
    ScheduleKind(
        'interleaved_1f1b', 'Megatron\'s interleaved 1F1B, virtual_stages cells per device for '
        'a smaller bubble', lambda k, m, v, r: orders.Interleaved(k, m, v),
        loss_inside_pipeline=True, virtual_stages=None, searched_virtual_stages=2,
        ideal_bubble=_InterleavedBubble),
    ScheduleKind(
        'zero_bubble', 'ZB-H1, 1f1b with the backward split into input and weight gradients, '
        'the weight gradients filling the drain, about a third of 1f1b\'s bubble',
        lambda k, m, v, r: orders.ZeroBubbleH1(k, m), loss_inside_pipeline=True,
        splits_backward=True),
    ScheduleKind(
        'zero_bubble_v', 'ZB-V, virtual_stages=2 cells per device in a V, cell s on device s '
        'for s < K, else on 2K-1-s, the backward split, at M >= K idling about a quarter '
        '(re-materializing) to a half of zero_bubble\'s time',
        lambda k, m, v, r: orders.ZeroBubbleV(k, m, r), loss_inside_pipeline=True,
        splits_backward=True, placement='v', virtual_stages=2, searched_virtual_stages=2),
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
        its actions by their costs, which this changes (`orders.ZeroBubbleV`).

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


def FirstMicroBatches(sched: Schedule, count: int) -> Schedule:
    """`sched` over its first `count` micro-batches only (all of them for a larger count): each
    device's list without the other micro-batches' actions, in its order. What a batch of
    fewer examples than M runs, so that no micro-batch is empty. It is valid where `sched` is:
    an action needs only actions of its own micro-batch and its device's earlier ones, and
    dropping whole micro-batches keeps the order of the rest.

    Raises:
      ScheduleError: for a count below 1.
    """
    if count >= sched.num_micro_batches:
        return sched
    lists = [[a for a in device if a.micro_batch < count] for device in sched.actions]
    return FromLists(lists, count, sched.virtual_stages, kind=sched.kind,
                     placement=sched.placement)


# ---- validation ---------------------------------------------------------------------------------
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
