"""The tools: the ``tf-asyncps`` command line, launch, the training job, bench,
and the bundled datasets and models.

* ``cli.py``: ``app.run(main)``; each command beside its own flags in
  ``launch_cmd.py``, ``train_cmd.py``, ``server_cmd.py``, ``reference_cmd.py``,
  ``bench_cmd.py``; the flags several commands read: ``shared_flags.py``;
* ``job.py``: the training job the chief runs (``model.fit``, metrics, export);
* ``bench.py``: the benchmark suite; ``straggler.py``: its straggler injection
  (public as ``tf_asyncps.straggler``);
* ``datasets.py``, ``models.py``: the bundled data (scikit-learn digits, MNIST)
  and tf_keras models.

Nothing in ``core/``, ``policies/`` or ``cluster/`` imports this layer.
"""
