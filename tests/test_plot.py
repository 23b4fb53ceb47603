"""Pipeline pictures: PNG files of the right size, one box per op, one bar per cell."""

import collections
import os
import shutil
import struct
import tempfile

import pytest
from absl.testing import absltest
from absl.testing import parameterized
from matplotlib import colors
from matplotlib import image as mpimage

from gpipe_tf.perf import memory
from gpipe_tf.perf import plot
from gpipe_tf.perf import simulator

pytestmark = pytest.mark.unit

_PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def _Timeline(k, m, recompute=True, forward=1.0, backward=2.0):
    costs = simulator.CellCosts(forward=[forward] * k, backward=[backward] * k)
    return simulator.Simulate(costs, m, recompute)


def _PngSize(data):
    """(width, height) from the IHDR chunk, which the PNG format puts first."""
    assert data[12:16] == b'IHDR', data[:16]
    return struct.unpack('>II', data[16:24])


def _ExpectedSize(figure):
    width, height = figure.get_size_inches() * figure.dpi
    return round(width), round(height)


def _Kind(patch):
    rgb = tuple(patch.get_facecolor()[:3])
    for kind, colour in plot.KIND_COLOURS.items():
        if rgb == colors.to_rgb(colour):
            return kind
    raise AssertionError(f'A box has colour {rgb}, which is no kind\'s.')


def _CellMemory(k, mib=(1, 1, 2, 8, 3), recompute=True):
    parts = [n * 2**20 for n in mib]
    # The schedule-walk fields do not enter the picture; plausible values.
    return memory.CellMemory(k, *parts, recompute=recompute, before_backward=sum(parts[:4]),
                             after_backward=2 * parts[0] + parts[2],
                             during_backward=(sum(parts[:4]),) * 4,
                             working_by_micro_batch=(parts[4],) * 4)


def _Plan(num_cells, mib=(1, 1, 2, 8, 3)):
    return memory.MemoryPlan(cells=[_CellMemory(k, mib) for k in range(num_cells)],
                             num_micro_batches=4, batch_size=32, slots_per_param=2,
                             input_bytes=2**20)


class TimelineFigureTest(parameterized.TestCase):

    @parameterized.named_parameters(('k3_m4', 3, 4, True), ('k4_m8', 4, 8, False))
    def testOneRowPerDeviceAndOneBoxPerInterval(self, k, m, recompute):
        timeline = _Timeline(k, m, recompute)
        ax = plot.TimelineFigure(timeline).axes[0]
        self.assertEqual([t.get_text() for t in ax.get_yticklabels()],
                         [f'dev {d} · cell {d}' for d in range(k)])
        self.assertLen(ax.patches, len(timeline.intervals))
        self.assertTrue(all(type(p).__name__ == 'Rectangle' for p in ax.patches))

    @parameterized.named_parameters(('k3_m4', 3, 4, True), ('k4_m8', 4, 8, False))
    def testBoxesAreColouredByKind(self, k, m, recompute):
        timeline = _Timeline(k, m, recompute)
        ax = plot.TimelineFigure(timeline).axes[0]
        self.assertEqual(collections.Counter(_Kind(p) for p in ax.patches),
                         collections.Counter(i.kind for i in timeline.intervals))

    def testBoxesSitOnTheirDevicesRowAtTheirTimes(self):
        timeline = _Timeline(3, 4)
        ax = plot.TimelineFigure(timeline).axes[0]
        for interval, patch in zip(timeline.intervals, ax.patches):
            self.assertAlmostEqual(patch.get_x(), interval.start)
            self.assertAlmostEqual(patch.get_width(), interval.end - interval.start)
            self.assertAlmostEqual(patch.get_y() + patch.get_height() / 2, interval.device)

    def testDeviceZeroIsTheTopRow(self):
        ax = plot.TimelineFigure(_Timeline(3, 4)).axes[0]
        bottom, top = ax.get_ylim()
        self.assertGreater(bottom, top)

    def testWideBoxesAreLabelledWithKindAndMicroBatch(self):
        timeline = _Timeline(3, 4)
        ax = plot.TimelineFigure(timeline).axes[0]
        self.assertEqual(
            collections.Counter(t.get_text() for t in ax.texts),
            collections.Counter(f'{i.kind[0].upper()}{i.micro_batch}' for i in timeline.intervals))

    def testNarrowBoxesAreNotLabelled(self):
        ax = plot.TimelineFigure(_Timeline(8, 64)).axes[0]
        self.assertEmpty(ax.texts)

    def testLegendNamesTheThreeKinds(self):
        ax = plot.TimelineFigure(_Timeline(3, 4, recompute=False)).axes[0]
        self.assertEqual([t.get_text() for t in ax.get_legend().get_texts()],
                         list(simulator.KINDS))

    def testOverlappingIntervalsOnOneDeviceDrawOneBoxEach(self):
        intervals = [
            simulator.Interval(0, 0, 0, 'forward', 0.0, 1.0),
            simulator.Interval(0, 0, 1, 'forward', 0.5, 1.5),  # A second thread of device 0.
            simulator.Interval(1, 1, 0, 'backward', 1.0, 2.0),
        ]
        timeline = simulator.Timeline(intervals, makespan=2.0, busy=[2.0, 1.0])
        ax = plot.TimelineFigure(timeline).axes[0]
        self.assertLen(ax.patches, 3)
        self.assertLen(ax.get_yticklabels(), 2)
        self.assertTrue(all(p.get_alpha() < 1 for p in ax.patches))

    def testDeviceNamesSetTheRows(self):
        names = ['GPU:0', 'GPU:1', 'GPU:2', 'GPU:3']  # One more than the timeline uses.
        ax = plot.TimelineFigure(_Timeline(3, 4), device_names=names).axes[0]
        self.assertEqual([t.get_text() for t in ax.get_yticklabels()], names)

    def testTitleShowsUtilisationAndIdeal(self):
        timeline = _Timeline(4, 8, recompute=False)
        ax = plot.TimelineFigure(timeline, title='K=4 M=8',
                                 ideal_utilisation=simulator.IdealUtilisation(8, 4)).axes[0]
        self.assertEqual(ax.get_title(),
                         'K=4 M=8: utilisation 72.7% (ideal 72.7%)')
        self.assertEqual(plot.TimelineFigure(timeline).axes[0].get_title(), 'utilisation 72.7%')

    def testShortStepsAreInMillisecondsLongOnesInSeconds(self):
        short = plot.TimelineFigure(_Timeline(2, 2, forward=1e-3, backward=2e-3)).axes[0]
        self.assertEqual(short.get_xlabel(), 'time (ms)')
        self.assertAlmostEqual(short.patches[0].get_width(), 1.0)
        long = plot.TimelineFigure(_Timeline(2, 2)).axes[0]
        self.assertEqual(long.get_xlabel(), 'time (s)')

    def testLargeTimelineDraws(self):
        timeline = _Timeline(8, 64)
        self.assertGreater(len(timeline.intervals), 1500)
        data = plot.PngBytes(plot.TimelineFigure(timeline))
        self.assertTrue(data.startswith(_PNG_SIGNATURE))

    def testEmptyTimelineRaises(self):
        with self.assertRaisesRegex(ValueError, 'no intervals'):
            plot.TimelineFigure(simulator.Timeline([], makespan=0.0, busy=[]))

    def testUnknownKindRaises(self):
        timeline = simulator.Timeline([simulator.Interval(0, 0, 0, 'idle', 0.0, 1.0)], 1.0, [1.0])
        with self.assertRaisesRegex(ValueError, "kind 'idle'"):
            plot.TimelineFigure(timeline)

    def testIntervalEndingBeforeItStartsRaises(self):
        timeline = simulator.Timeline([simulator.Interval(0, 0, 0, 'forward', 2.0, 1.0)], 2.0,
                                      [1.0])
        with self.assertRaisesRegex(ValueError, 'start 2.0 and end 1.0'):
            plot.TimelineFigure(timeline)

    def testTooFewDeviceNamesRaises(self):
        with self.assertRaisesRegex(ValueError, '2 names for 3 devices'):
            plot.TimelineFigure(_Timeline(3, 4), device_names=['a', 'b'])

    def testIdealUtilisationOutsideUnitIntervalRaises(self):
        with self.assertRaisesRegex(ValueError, 'ideal_utilisation'):
            plot.TimelineFigure(_Timeline(3, 4), ideal_utilisation=72.7)


class CellCostFigureTest(absltest.TestCase):

    def testOneBarPerCellAndADashedMean(self):
        costs = [1.0, 3.0, 2.0]
        ax = plot.CellCostFigure(costs).axes[0]
        self.assertEqual([p.get_height() for p in ax.patches], costs)
        [mean] = ax.lines
        self.assertEqual(mean.get_linestyle(), '--')
        self.assertEqual(list(mean.get_ydata()), [2.0, 2.0])

    def testTitleShowsMaxOverMean(self):
        ax = plot.CellCostFigure([1.0, 3.0, 2.0], title='AmoebaNet').axes[0]
        self.assertEqual(ax.get_title(), 'AmoebaNet: max/mean = 1.50')

    def testLabelsAndUnit(self):
        ax = plot.CellCostFigure([1, 2], unit='params', labels=['stem', 'head']).axes[0]
        self.assertEqual([t.get_text() for t in ax.get_xticklabels()], ['stem', 'head'])
        self.assertEqual(ax.get_ylabel(), 'params')

    def testAllZeroCostsAreBalanced(self):
        ax = plot.CellCostFigure([0, 0]).axes[0]
        self.assertEqual(ax.get_title(), 'max/mean = 1.00')

    def testNoCostsRaises(self):
        with self.assertRaisesRegex(ValueError, 'at least one'):
            plot.CellCostFigure([])

    def testNegativeCostRaises(self):
        with self.assertRaisesRegex(ValueError, r'costs\[1\] = -1.0'):
            plot.CellCostFigure([1, -1])

    def testNonFiniteCostRaises(self):
        with self.assertRaisesRegex(ValueError, r'costs\[0\] = nan'):
            plot.CellCostFigure([float('nan')])

    def testLabelsNotOnePerCellRaises(self):
        with self.assertRaisesRegex(ValueError, '1 labels for 2 cells'):
            plot.CellCostFigure([1, 2], labels=['a'])


class MemoryFigureTest(absltest.TestCase):

    def testOneSegmentPerComponentPerCell(self):
        ax = plot.MemoryFigure(_Plan(3)).axes[0]
        self.assertLen(ax.patches, len(memory.COMPONENTS) * 3)
        self.assertEmpty(ax.lines)

    def testSegmentsStackToEachCellsTotal(self):
        plan = _Plan(2)
        ax = plot.MemoryFigure(plan).axes[0]
        tops = collections.defaultdict(float)
        for patch in ax.patches:
            x = round(patch.get_x() + patch.get_width() / 2)
            tops[x] = max(tops[x], patch.get_y() + patch.get_height())
        self.assertEqual(dict(tops), {k: c.total / 2**20 for k, c in enumerate(plan.cells)})

    def testDeviceMemoryLine(self):
        ax = plot.MemoryFigure(_Plan(4), device_bytes=16 * 2**20).axes[0]
        self.assertLen(ax.patches, len(memory.COMPONENTS) * 4)
        [line] = ax.lines
        self.assertEqual(line.get_label(), 'device memory')
        self.assertEqual(list(line.get_ydata()), [16.0, 16.0])
        self.assertEqual([t.get_text() for t in ax.get_legend().get_texts()],
                         [name.replace('_', ' ') for name in reversed(memory.COMPONENTS)]
                         + ['device memory'])

    def testUnitFollowsMagnitude(self):
        self.assertEqual(plot.MemoryFigure(_Plan(2)).axes[0].get_ylabel(), 'memory (MiB)')
        big = _Plan(2, mib=(1024, 1024, 2048, 512, 64))
        self.assertEqual(plot.MemoryFigure(big).axes[0].get_ylabel(), 'memory (GiB)')
        small_on_big_device = plot.MemoryFigure(_Plan(2), device_bytes=16 * 2**30)
        self.assertEqual(small_on_big_device.axes[0].get_ylabel(), 'memory (GiB)')

    def testNoCellsRaises(self):
        with self.assertRaisesRegex(ValueError, 'no cells'):
            plot.MemoryFigure(_Plan(0))

    def testNonPositiveDeviceBytesRaises(self):
        with self.assertRaisesRegex(ValueError, 'device_bytes must be > 0, got 0'):
            plot.MemoryFigure(_Plan(2), device_bytes=0)


class TickLabelsTest(parameterized.TestCase):
    """Cell labels under the bars never print over each other, up to the paper's K=128."""

    @parameterized.parameters(8, 32, 48, 128)
    def testRenderedLabelsDoNotOverlap(self, num_cells):
        for figure in (plot.MemoryFigure(_Plan(num_cells)),
                       plot.CellCostFigure([1.0] * num_cells)):
            canvas = plot._Canvas(figure)  # pylint: disable=protected-access
            canvas.draw()
            renderer = canvas.get_renderer()
            labels = [t for t in figure.axes[0].get_xticklabels() if t.get_text()]
            boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
            for left, right in zip(boxes, boxes[1:]):
                self.assertLessEqual(left.x1, right.x0)
            # Every bar is labelled while they fit; beyond, every 2nd bar's at 48 cells (24
            # labels), every 4th at 128 (32), counted by hand.
            self.assertLen(labels, {8: 8, 32: 32, 48: 24, 128: 32}[num_cells])
            self.assertEqual(figure.axes[0].get_xticks()[0], 0)


class PngTest(absltest.TestCase):

    def testSavePngWritesAPngOfTheFiguresSize(self):
        figure = plot.TimelineFigure(_Timeline(3, 4))
        # tempfile, not create_tempdir(): that needs absl flags, which pytest does not parse.
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root)
        path = os.path.join(root, 'step', 'timeline.png')
        self.assertEqual(plot.SavePng(figure, path), path)
        with open(path, 'rb') as f:
            data = f.read()
        self.assertTrue(data.startswith(_PNG_SIGNATURE))
        self.assertEqual(_PngSize(data), _ExpectedSize(figure))
        self.assertEqual(_ExpectedSize(figure), (1000, 300))  # 10 in by 3 rows + margins.
        height, width, _ = mpimage.imread(path).shape
        self.assertEqual((width, height), (1000, 300))

    def testPngBytesOfEachFigure(self):
        for figure in [plot.TimelineFigure(_Timeline(4, 8)), plot.CellCostFigure([1, 2, 3]),
                       plot.MemoryFigure(_Plan(3), device_bytes=2**30)]:
            data = plot.PngBytes(figure)
            self.assertTrue(data.startswith(_PNG_SIGNATURE))
            self.assertEqual(_PngSize(data), _ExpectedSize(figure))

    def testImageArrayIsOneRgbaImage(self):
        figure = plot.TimelineFigure(_Timeline(4, 8))
        image = plot.ImageArray(figure)
        width, height = _ExpectedSize(figure)
        self.assertEqual(image.shape, (1, height, width, 4))
        self.assertEqual(image.dtype.name, 'uint8')
        self.assertGreater(len(set(image[0, :, :, 0].ravel().tolist())), 2)  # Not blank.


if __name__ == '__main__':
    absltest.main()
