"""tf_asyncps: asynchronous parameter-server training for TensorFlow 2.

Public API (see README.md and DESIGN.md):

* :class:`AsyncParameterServerStrategy`: a ``tf.distribute.ParameterServerStrategy``
  with pluggable update policies and staleness tracking.
* :class:`StalenessStats`: what ``strategy.staleness_stats()`` returns.
* :mod:`tf_asyncps.policies`, :mod:`tf_asyncps.cluster`, :mod:`tf_asyncps.callbacks`.
"""

__version__ = "0.1.0"

from tf_asyncps import cluster, policies
from tf_asyncps.staleness import StalenessStats
from tf_asyncps.strategy import AsyncParameterServerStrategy
from tf_asyncps import callbacks

__all__ = ["AsyncParameterServerStrategy", "StalenessStats", "policies", "cluster",
           "callbacks", "__version__"]
