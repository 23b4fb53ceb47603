"""The GPU partition report without a GPU: a fake nvidia-smi (a shell script printing fixed CSV,
or failing) stands in for the real one, and the plans are real plans of a small model."""

import os
import re
import shutil
import tempfile
from unittest import mock

import tensorflow as tf

from gpipe_tf.layers import basic
from gpipe_tf.perf import memory
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.train import gpu as gpu_lib

MIB = 2**20
UUID_0 = 'GPU-8932f937-d72c-4106-c12f-20bd9faed9f6'
UUID_1 = 'GPU-5b1e2c3d-0a9f-4e11-8c77-3f0d2a6b4c10'
# What the fake prints: index, uuid, name, free MiB, total MiB.
TWO_GPUS = (f'0, {UUID_0}, NVIDIA H100 80GB HBM3, 80000, 81559\n'
            f'1, {UUID_1}, NVIDIA H100 80GB HBM3, 2, 81559\n')
ARGS = '--query-gpu=index,uuid,name,memory.free,memory.total --format=csv,noheader,nounits'
GPU_DEVICES = ['/device:GPU:0', '/job:localhost/replica:0/task:0/device:GPU:1']


def _Plan(num_cells=4):
    """The plan of a small pipeline whose cell k has k + 1 layers: every cell's peak differs."""
    dense = basic.DenseLayer.Params().Set(input_dim=256, output_dim=256, activation='relu')
    p = pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', num_micro_batches=4, recompute='always', input_shapes=[128, 256],
        cell_tpl=[[dense.Copy() for _ in range(k + 1)] for k in range(num_cells)])
    return memory.PlanMemory(p, slots_per_param=2)


def _Gpus(*free_bytes):
    return [gpu_lib.GpuMemory(index=i, uuid=f'GPU-{i}', name='Fake GPU', free_bytes=free,
                              total_bytes=80 * 1024 * MIB) for i, free in enumerate(free_bytes)]


def _Columns(line):
    """A table row's values: columns are two or more spaces apart; a value has single spaces."""
    return re.split(r'\s{2,}', line.strip())


class FakeSmiTest(tf.test.TestCase):
    """Each test writes its own fake nvidia-smi into a fresh directory."""

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)

    def Fake(self, body, name='nvidia-smi'):
        """An executable shell script `name` that fails unless given nvidia-smi's query
        arguments, then runs `body`."""
        path = os.path.join(self.dir, name)
        with open(path, 'w') as f:
            f.write('#!/bin/sh\n'
                    f'if [ "$*" != "{ARGS}" ]; then\n'
                    '  echo "unexpected arguments: $*" >&2; exit 9\n'
                    'fi\n'
                    f'{body}\n')
        os.chmod(path, 0o755)
        return path

    def Printing(self, text, name='nvidia-smi'):
        return self.Fake(f"cat <<'EOF'\n{text}EOF", name)


class QueryGpusTest(FakeSmiTest):

    def testParsesTwoGpus(self):
        gpus = gpu_lib.QueryGpus(self.Printing(TWO_GPUS))
        self.assertEqual(gpus, [
            gpu_lib.GpuMemory(0, UUID_0, 'NVIDIA H100 80GB HBM3', 80000 * MIB, 81559 * MIB),
            gpu_lib.GpuMemory(1, UUID_1, 'NVIDIA H100 80GB HBM3', 2 * MIB, 81559 * MIB)])

    def testFindsTheDefaultNameOnPath(self):
        self.Printing(TWO_GPUS)
        path = self.dir + os.pathsep + os.environ.get('PATH', '')
        with mock.patch.dict(os.environ, {'PATH': path}):
            gpus = gpu_lib.QueryGpus()
        self.assertEqual([(g.index, g.free_bytes) for g in gpus], [(0, 80000 * MIB),
                                                                   (1, 2 * MIB)])

    def testMissingCommand(self):
        absent = os.path.join(self.dir, 'nvidia-smi')
        with self.assertRaisesRegex(gpu_lib.GpuQueryError, 'was not found'):
            gpu_lib.QueryGpus(absent)

    def testNonZeroExitQuotesStderr(self):
        smi = self.Fake('echo "Failed to initialize NVML: Driver/library version mismatch" >&2\n'
                        'echo "second line" >&2\nexit 1')
        with self.assertRaisesRegex(gpu_lib.GpuQueryError,
                                    r'exited with status 1: Failed to initialize NVML: '
                                    r'Driver/library version mismatch$'):
            gpu_lib.QueryGpus(smi)

    def testNonZeroExitWithStdoutOnly(self):
        smi = self.Fake('echo "No devices were found"\nexit 6')
        with self.assertRaisesRegex(gpu_lib.GpuQueryError,
                                    'exited with status 6: No devices were found'):
            gpu_lib.QueryGpus(smi)

    def testMalformedLineIsQuoted(self):
        smi = self.Printing(f'0, {UUID_0}, NVIDIA H100 80GB HBM3, [N/A], 81559\n')
        with self.assertRaisesRegex(
                gpu_lib.GpuQueryError,
                re.escape(f"printed '0, {UUID_0}, NVIDIA H100 80GB HBM3, [N/A], 81559': "
                          'expected 5 comma-separated columns index, uuid, name, memory.free, '
                          'memory.total')):
            gpu_lib.QueryGpus(smi)
        with self.assertRaisesRegex(gpu_lib.GpuQueryError, "printed '0, 80000': expected 5"):
            gpu_lib.QueryGpus(self.Printing('0, 80000\n', name='short'))

    def testTimeout(self):
        smi = self.Fake('exec sleep 30')  # exec: the kill on timeout reaches the sleeper.
        with self.assertRaisesRegex(gpu_lib.GpuQueryError, 'did not finish within 0.5 s'):
            gpu_lib.QueryGpus(smi, timeout_s=0.5)


class VisibleGpusTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.gpus = [gpu_lib.GpuMemory(i, uuid, 'G', i * MIB, 8 * MIB)
                     for i, uuid in ((1, UUID_1), (0, UUID_0))]
        self.gpu0, self.gpu1 = self.gpus[1], self.gpus[0]

    def testUnsetShowsAllInIndexOrder(self):
        self.assertEqual(gpu_lib.VisibleGpus(self.gpus, None), [self.gpu0, self.gpu1])

    def testByIndexInTheGivenOrder(self):
        self.assertEqual(gpu_lib.VisibleGpus(self.gpus, '1,0'), [self.gpu1, self.gpu0])
        self.assertEqual(gpu_lib.VisibleGpus(self.gpus, ' 1 '), [self.gpu1])

    def testByUuidAndUuidPrefix(self):
        self.assertEqual(gpu_lib.VisibleGpus(self.gpus, f'{UUID_1},{UUID_0}'),
                         [self.gpu1, self.gpu0])
        self.assertEqual(gpu_lib.VisibleGpus(self.gpus, 'GPU-8932f937'), [self.gpu0])

    def testEntryMatchingNothingIsNamed(self):
        with self.assertRaisesRegex(gpu_lib.GpuQueryError, "entry '2' matches no GPU"):
            gpu_lib.VisibleGpus(self.gpus, '0,2')
        with self.assertRaisesRegex(gpu_lib.GpuQueryError, "entry 'GPU-ffff' matches no GPU"):
            gpu_lib.VisibleGpus(self.gpus, 'GPU-ffff')
        with self.assertRaisesRegex(gpu_lib.GpuQueryError, "entry '8932f937' matches no GPU"):
            gpu_lib.VisibleGpus(self.gpus, '8932f937')  # CUDA wants the 'GPU-' prefix.

    def testAmbiguousPrefixAndRepeatAreErrors(self):
        with self.assertRaisesRegex(gpu_lib.GpuQueryError, "'GPU-' is a prefix of 2 GPUs"):
            gpu_lib.VisibleGpus(self.gpus, 'GPU-')
        with self.assertRaisesRegex(gpu_lib.GpuQueryError, "entry '0' names GPU 0 again"):
            gpu_lib.VisibleGpus(self.gpus, f'{UUID_0},0')

    def testEmptyOrNegativeHidesGpus(self):
        self.assertEqual(gpu_lib.VisibleGpus(self.gpus, ''), [])
        self.assertEqual(gpu_lib.VisibleGpus(self.gpus, '-1'), [])
        self.assertEqual(gpu_lib.VisibleGpus(self.gpus, '1,-1,0'), [self.gpu1])


class MemoryReportTest(tf.test.TestCase):

    def testRoundRobinSumsPerGpuAndReportsTheShortfall(self):
        plan = _Plan(num_cells=4)
        devices = devices_lib.StageDevices(GPU_DEVICES, 4)  # Cells 0, 2 on GPU 0; 1, 3 on GPU 1.
        self.assertEqual(devices, GPU_DEVICES * 2)
        totals = [cell.total for cell in plan.cells]
        self.assertLen(set(totals), 4)  # So a cell counted on the wrong GPU changes a sum.
        on_gpu0, on_gpu1 = totals[0] + totals[2], totals[1] + totals[3]
        # GPU 0 has exactly what its cells need; GPU 1 is 3 MiB short.
        gpus = _Gpus(on_gpu0, on_gpu1 - 3 * MIB)
        self.assertEqual(gpu_lib.Shortfalls(plan, devices, gpus), {1: 3 * MIB})

        lines = gpu_lib.MemoryReport(plan, devices, gpus).splitlines()
        cell_rows = {int(c[0]): c for c in map(_Columns, lines) if re.fullmatch(r'\d+', c[0])}
        self.assertEqual(sorted(cell_rows), [0, 1, 2, 3])
        for cell, row in cell_rows.items():
            free = gpus[cell % 2].free_bytes
            self.assertEqual(row, [str(cell), devices[cell], f'{totals[cell] / MIB:.1f}',
                                   f'GPU:{cell % 2}', 'Fake GPU', f'{free / MIB:.1f}'])
        gpu_rows = [_Columns(l) for l in lines if l.startswith('GPU:')]
        self.assertEqual(gpu_rows, [
            ['GPU:0', 'Fake GPU', '0,2', f'{on_gpu0 / MIB:.1f}', f'{on_gpu0 / MIB:.1f}', 'fits'],
            ['GPU:1', 'Fake GPU', '1,3', f'{on_gpu1 / MIB:.1f}', f'{(on_gpu1 - 3 * MIB) / MIB:.1f}',
             'DOES NOT FIT (short by 3.0 MiB)']])

    def testEveryCellFitsWithRoom(self):
        plan = _Plan(num_cells=2)
        gpus = _Gpus(*[2 * cell.total for cell in plan.cells])
        self.assertEqual(gpu_lib.Shortfalls(plan, GPU_DEVICES, gpus), {})
        self.assertNotIn('DOES NOT FIT', gpu_lib.MemoryReport(plan, GPU_DEVICES, gpus))

    def testUnusedGpuHasNoRow(self):
        plan = _Plan(num_cells=2)
        gpus = _Gpus(80 * 1024 * MIB, 80 * 1024 * MIB, 0)
        text = gpu_lib.MemoryReport(plan, ['/device:GPU:2', '/device:GPU:2'], gpus)
        self.assertEqual([_Columns(l)[:3] for l in text.splitlines() if l.startswith('GPU:')],
                         [['GPU:2', 'Fake GPU', '0,1']])
        self.assertEqual(gpu_lib.Shortfalls(plan, ['/device:GPU:2'] * 2, gpus),
                         {2: plan.cells[0].total + plan.cells[1].total})

    def testBadDevicesAreNamed(self):
        plan = _Plan(num_cells=2)
        gpus = _Gpus(MIB, MIB)
        with self.assertRaisesRegex(ValueError, "'/device:CPU:0' is not a GPU device"):
            gpu_lib.MemoryReport(plan, ['/device:GPU:0', '/device:CPU:0'], gpus)
        with self.assertRaisesRegex(ValueError,
                                    "'/device:GPU:2' is GPU 2, but only 2 GPUs are visible"):
            gpu_lib.Shortfalls(plan, ['/device:GPU:0', '/device:GPU:2'], gpus)
        with self.assertRaisesRegex(ValueError, "on job 'worker'"):
            gpu_lib.MemoryReport(plan, ['/job:worker/task:1/device:GPU:0'] * 2, gpus)
        with self.assertRaisesRegex(ValueError, 'has 2 cells but 1 stage devices'):
            gpu_lib.MemoryReport(plan, ['/device:GPU:0'], gpus)


class ReportTest(FakeSmiTest):

    def testAppliesCudaVisibleDevices(self):
        plan = _Plan(num_cells=2)
        smi = self.Printing(TWO_GPUS)
        # TF's GPU:0 is nvidia-smi's GPU 1 (2 MiB free): both cells on it do not fit.
        text = gpu_lib.Report(plan, ['/device:GPU:0'] * 2, smi, {'CUDA_VISIBLE_DEVICES': '1'})
        needed = plan.cells[0].total + plan.cells[1].total
        self.assertGreater(needed, 2 * MIB)  # Else the model is too small to test this.
        rows = [_Columns(l) for l in text.splitlines() if l.startswith('GPU:')]
        self.assertEqual(rows, [[
            'GPU:0 (nvidia-smi 1)', 'NVIDIA H100 80GB HBM3', '0,1', f'{needed / MIB:.1f}',
            '2.0', f'DOES NOT FIT (short by {(needed - 2 * MIB) / MIB:.1f} MiB)']])
        with self.assertRaisesRegex(ValueError, 'only 1 GPUs are visible'):
            gpu_lib.Report(plan, GPU_DEVICES, smi, {'CUDA_VISIBLE_DEVICES': '1'})

    def testMissingCommandFallsBackToThePlan(self):
        plan = _Plan(num_cells=4)
        devices = GPU_DEVICES * 2
        text = gpu_lib.Report(plan, devices, os.path.join(self.dir, 'nvidia-smi'), {})
        lines = text.splitlines()
        self.assertRegex(lines[0], r'^free GPU memory unknown: .*was not found')
        self.assertEqual([_Columns(l) for l in lines[2:]],
                         [[str(k), devices[k], f'{plan.cells[k].total / MIB:.1f}']
                          for k in range(4)])

    def testBadCudaVisibleDevicesFallsBack(self):
        text = gpu_lib.Report(_Plan(num_cells=2), GPU_DEVICES, self.Printing(TWO_GPUS),
                              {'CUDA_VISIBLE_DEVICES': '7'})
        self.assertStartsWith(text, "free GPU memory unknown: CUDA_VISIBLE_DEVICES='7': entry "
                              "'7' matches no GPU")


class TrainerReportTest(FakeSmiTest):
    """What `--run_locally=gpu` prints before training: the registered MLP's 4 cells on the
    two GPUs nvidia-smi (the fake, first on PATH) reports."""

    def testTheTrainersReportUsesTheTaskPlanAndNvidiaSmiOnPath(self):
        from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
        from gpipe_tf.perf import pictures  # pylint: disable=g-import-not-at-top
        from gpipe_tf.tasks import base_task  # pylint: disable=g-import-not-at-top
        p = base_task.SyncInputShapes(model_registry.GetParams('examples.PipelinedMLP', 'Train'))
        p.model.devices = ['/device:GPU:0', '/device:GPU:1']
        p.model.round_robin = True  # 4 cells on 2 GPUs.
        self.Printing(TWO_GPUS.replace(', 2, 81559', ', 0, 81559'))  # GPU 1 is full.
        environ = {'PATH': self.dir + os.pathsep + os.environ.get('PATH', '')}
        with mock.patch.dict(os.environ, environ):
            os.environ.pop('CUDA_VISIBLE_DEVICES', None)
            text = gpu_lib.PipelineReport(p)
        plan = pictures.Plan(p).memory
        self.assertStartsWith(text, "Planned peak memory per cell against its GPU's free memory")
        rows = {_Columns(l)[0]: _Columns(l) for l in text.splitlines() if l.startswith('GPU:')}
        for position, cells in ((0, (0, 2)), (1, (1, 3))):
            needed = sum(plan.cells[k].total for k in cells)
            self.assertEqual(rows[f'GPU:{position}'][2:4],
                             [f'{cells[0]},{cells[1]}', f'{needed / MIB:.1f}'])
        self.assertEqual(rows['GPU:0'][-1], 'fits')  # 80000 MiB free.
        self.assertEqual(rows['GPU:1'][-1],
                         f'DOES NOT FIT (short by {rows["GPU:1"][3]} MiB)')  # 0 MiB free.

    def testNoReportForReplicasOrDevicesThatAreNotGpus(self):
        from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
        from gpipe_tf.tasks import base_task  # pylint: disable=g-import-not-at-top
        p = base_task.SyncInputShapes(model_registry.GetParams('examples.PipelinedMLP', 'Train'))
        p.model.num_replicas = 2
        self.assertEqual(gpu_lib.PipelineReport(p), 'No GPU memory report: the memory plan '
                         'covers one pipeline, not 2 replicas.')
        p.model.num_replicas = 1
        p.model.devices = ['/device:CPU:0']
        self.assertStartsWith(gpu_lib.PipelineReport(p),
                              "No GPU memory report: '/device:CPU:0' is not a GPU device")

    def testNoPlanWithoutInputShapes(self):
        from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
        p = model_registry.GetParams('examples.PipelinedMLP', 'Train')
        p.model.input_shapes = None
        p.model.partition_method = 'uniform'
        self.assertStartsWith(gpu_lib.PipelineReport(p), 'No GPU memory report: ')


if __name__ == '__main__':
    tf.test.main()
