"""gpipe_tf: GPipe pipeline parallelism for TensorFlow, in the style of Lingvo."""

import setuptools

setuptools.setup(
    name='gpipe_tf',
    version='0.1.0',
    description='GPipe pipeline parallelism for TensorFlow, in the style of Lingvo.',
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    packages=setuptools.find_packages(include=['gpipe_tf', 'gpipe_tf.*']),
    package_data={'gpipe_tf': ['**/*.txt', '**/*.tsv', '**/LICENSE*']},
    python_requires='>=3.11',
    install_requires=[
        'tensorflow>=2.21,<2.22',
        'keras>=3',  # gpipe_tf.keras (TensorFlow 2.21 installs it too).
        'absl-py',
        'numpy',
        'tensorboard>=2.21,<2.22',  # tf.summary's implementation; no longer a TF dependency.
        'sacrebleu',  # BLEU of the translation models.
        'scikit-learn',  # The digits dataset (DigitsInput).
        'matplotlib',  # Timeline, cell cost and memory pictures (gpipe_tf/perf/plot.py).
    ],
    extras_require={
        # -n 2: the suite on two worker processes; keras-hub's Transformer blocks are the
        # Keras tests' and examples' (gpipe_tf.keras itself needs only Keras).
        'test': ['pytest', 'pytest-xdist', 'keras-hub>=0.32'],
        'keras_hub': ['keras-hub>=0.32'],
        # The documentation site: `mkdocs build --strict` (mkdocs.yml, docs/).
        'docs': ['mkdocs>=1.6'],
    },
    entry_points={'console_scripts': ['gpipe-train = gpipe_tf.trainer:Run']},
    license='Apache-2.0',
)
