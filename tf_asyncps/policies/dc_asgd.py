"""``dc_asgd``: delay-compensated asynchronous SGD.

Rule: g + λ · g ⊙ g ⊙ (w_now − w_read), a first-order Taylor correction of a
stale gradient towards the current parameters, with g ⊙ g approximating the
Hessian's diagonal (Zheng et al., "Asynchronous Stochastic Gradient Descent
with Delay Compensation", ICML 2017). Adaptive variant (DC-ASGD-a):
λ_t = λ / sqrt(meansquare + ε), meansquare ← m·meansquare + (1 − m)·g ⊙ g.

w_read is the value the worker step read (the paper's per-worker backup): the
engine reads each variable the step updates on its PS task right after the
step's read step r and keeps that read until the update
(``needs_read_values``); nothing is copied.

When to use: many workers and a smooth loss, to keep asynchronous speed while
reducing the error of stale gradients. Costs one PS-local read per updated
variable per worker step.
"""

import tensorflow as tf

from tf_asyncps.policies import registry
from tf_asyncps.core import placement
from tf_asyncps.core.grads import map_values
from tf_asyncps.policies.base import UpdatePolicy
from tf_asyncps.validate import check_number

__all__ = ["DCASGD", "delay_compensate"]


def delay_compensate(grad, w_now, w_read, lambda_):
    """The rule on dense tensors: ``g + lambda_ * g * g * (w_now - w_read)``."""
    lam = tf.cast(lambda_, grad.dtype)
    return grad + lam * grad * grad * (w_now - w_read)


def _rows(t, grad):
    """The rows of ``t`` (a tensor, or a variable: gathered from it, since a
    read of a variable that sparse ops touch copies all of it) that ``grad``
    updates; all of it for a dense ``grad``."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.gather(t, grad.indices)
    return t.read_value() if isinstance(t, tf.Variable) else t


@registry.register("dc_asgd")
class DCASGD(UpdatePolicy):
    """Delay-compensated gradients (Zheng et al., ICML 2017).

    Args:
      lambda_: variance-control λ >= 0 (float); 0 gives plain async SGD.
      adaptive: use λ / sqrt(meansquare + epsilon) (DC-ASGD-a).
      momentum: m of the meansquare moving average, 0 <= m < 1.
      epsilon: added under the square root (float > 0).

    Raises:
      ValueError: negative λ, m outside [0, 1), epsilon <= 0.
    """

    needs_read_values = True

    def __init__(self, lambda_: float = 0.04, adaptive: bool = False,
                 momentum: float = 0.95, epsilon: float = 1e-7):
        check_number(lambda_, "dc_asgd: lambda_", min=0, hint="the delay-compensation strength")
        check_number(momentum, "dc_asgd: momentum", min=0, below=1)
        check_number(epsilon, "dc_asgd: epsilon", above=0)
        self.lambda_ = float(lambda_)
        self.adaptive = bool(adaptive)
        self.momentum = float(momentum)
        self.epsilon = float(epsilon)

    def init(self, variables):
        if not self.adaptive:
            return ()
        out = []
        for v in variables:
            with placement.beside(v):
                out.append(tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                       name="dc_asgd_meansquare"))
        return out

    def update(self, grads, state, info):
        new = []
        for i, (g, w, w_read) in enumerate(zip(grads, info.variables, info.read_values)):
            if w_read is None:
                new.append(g)
                continue
            gap = _rows(w, g) - _rows(w_read, g)
            if self.adaptive:
                rows = self._update_meansquare(state[i], g)
                lam = self.lambda_ / tf.sqrt(rows + self.epsilon)
            else:
                lam = self.lambda_
            new.append(map_values(
                lambda v, gap=gap, lam=lam: v + tf.cast(lam, v.dtype) * v * v * gap, g))
        return new, True

    def _update_meansquare(self, ms, g):
        """meansquare <- m * meansquare + (1 - m) * g * g, a read then a
        write: serialised per variable, so that concurrent worker steps do not
        lose each other's update. Returns the new rows (dense: all)."""
        m = self.momentum

        def update():
            if isinstance(g, tf.IndexedSlices):
                rows = m * tf.gather(ms, g.indices) + (1 - m) * tf.square(g.values)
                with tf.control_dependencies(
                        [ms.scatter_update(tf.IndexedSlices(rows, g.indices))]):
                    return tf.identity(rows)
            return ms.assign(m * ms.read_value() + (1 - m) * tf.square(g), read_value=True)

        return self._lock_for(ms).execute(update, exclusive_resource_access=False)

    def _lock_for(self, ms) -> tf.CriticalSection:
        locks = self.__dict__.setdefault("_meansquare_locks", {})
        if id(ms) not in locks:
            with tf.init_scope(), tf.device(ms.device):
                locks[id(ms)] = (placement.critical_section("dc_asgd_meansquare_lock"), ms)
        return locks[id(ms)][0]

    def get_config(self):
        return {"lambda_": self.lambda_, "adaptive": self.adaptive,
                "momentum": self.momentum, "epsilon": self.epsilon}
