"""What a policy made of other policies (``chain``, ``route``) forwards to them.

Every protocol hook outside ``init``/``update`` (tf_asyncps/core/protocol.py)
goes to each member in order, so a member's wait before the read, its clock
tick after the step and its watchdog happen inside a composite exactly as
alone.
"""

from tf_asyncps.policies.base import UpdatePolicy

__all__ = ["Composite"]


class Composite(UpdatePolicy):
    """Base of composite policies: ``members()`` are the policies forwarded to.

    ``atomic``, ``needs_read_values`` and ``aggregates`` hold if any member's
    does (set by :meth:`_take_member_flags`).
    """

    def members(self):
        raise NotImplementedError

    def _take_member_flags(self) -> None:
        ms = self.members()
        self.atomic = any(p.atomic for p in ms)
        self.needs_read_values = any(p.needs_read_values for p in ms)
        self.aggregates = any(p.aggregates for p in ms)

    def validate_cluster(self, num_workers):
        for p in self.members():
            p.validate_cluster(num_workers)

    def build(self, num_workers, device):
        """Builds each member; returns their cluster states, in order."""
        return [p.build(num_workers, device) for p in self.members()]

    def attach(self, runtime):
        for p in self.members():
            p.attach(runtime)

    def before_read(self, worker_index):
        return [op for p in self.members() for op in p.before_read(worker_index)]

    def after_step(self, worker_index):
        return [op for p in self.members() for op in p.after_step(worker_index)]

    def step_without_update(self, worker_index):
        return [op for p in self.members() for op in p.step_without_update(worker_index)]

    def watchdogs(self):
        return [w for p in self.members() for w in p.watchdogs()]
