"""What the callbacks of every framework share: console values and the
strategy check. No TensorFlow, tf_keras or Keras import."""

import numpy as np

__all__ = ["format_value", "plain_value", "strategy_of"]


def format_value(v) -> str:
    """A log value for a console line: ``0.4121``; a vector metric (e.g.
    Precision at several thresholds) as ``[0.5000, 0.7500]``."""
    a = np.asarray(v, dtype=float)
    if a.ndim == 0:
        return f"{float(a):.4f}"
    return "[" + ", ".join(f"{x:.4f}" for x in a.ravel()) + "]"


def plain_value(v):
    """A float for a scalar log value, else a list of floats (JSON-ready)."""
    a = np.asarray(v, dtype=float)
    return float(a) if a.ndim == 0 else a.tolist()


def strategy_of(model):
    """``model.distribute_strategy`` if it is an AsyncParameterServerStrategy.

    Raises:
      ValueError: the model was not built under that strategy's scope.
    """
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None or not hasattr(strategy, "staleness_stats"):
        raise ValueError(
            "tf_asyncps callbacks need a model built under "
            "AsyncParameterServerStrategy.scope().")
    return strategy
