"""The registered-model table, computed from Params alone."""

import tensorflow as tf

from gpipe_tf import model_registry
from gpipe_tf.tools import model_table


class ModelTableTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        graph = tf.Graph()
        with graph.as_default():  # Any TF op or variable would land here.
            cls.rows = [model_table.Row(key) for key in model_registry.ListModels()]
        cls.graph_ops = len(graph.get_operations())

    def testEveryRegisteredModelHasARowAndNoOpIsBuilt(self):
        self.assertEqual([r.model for r in self.rows], model_registry.ListModels())
        self.assertEqual(self.graph_ops, 0)

    def testParameterMemoryIsTwelveBytesPerParameter(self):
        for r in self.rows:
            self.assertGreater(r.num_params, 0, r.model)
            self.assertEqual(r.param_bytes, 12 * r.num_params, r.model)

    def testRematerializationCutsActivationMemoryOfPipelinedPaperModels(self):
        # (Tiny models with one small layer per cell can keep more at cell boundaries.)
        for r in self.rows:
            if r.num_micro_batches > 1 and r.num_cells > 1 and r.num_params > 10**8:
                self.assertLess(r.remat_activation_bytes, r.activation_bytes, r.model)

    def testBalanceIsAtLeastOne(self):
        for r in self.rows:
            self.assertGreaterEqual(r.flops_balance, 1.0 - 1e-9, r.model)

    def testTableHasAHeaderAndOneLinePerModel(self):
        table = model_table.FormatTable(self.rows)
        self.assertLen(table.splitlines(), len(self.rows) + 1)
        self.assertIn('lm.TransformerL_1663', table)


if __name__ == '__main__':
    tf.test.main()
