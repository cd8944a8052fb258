"""Tools around the user package: the ``spyre-jax`` command line (:mod:`.cli`, which loads the
rest only for the command it runs), the demo (:mod:`.demo`), the benchmarks (:mod:`.bench`), the
op coverage runs (:mod:`.coverage_run`, :mod:`.coverage_common`, :mod:`.coverage_jax`,
:mod:`.coverage_torch`, the JAX op table :mod:`.jax_ops`) and differential testing across the
JAX and PyTorch frontends (:mod:`.testing`).

Importing this package imports none of them; most need both JAX and PyTorch.
"""
