"""``tf-asyncps reference``: the job's model trained in this one process. Its
flags: the job's and --console (shared_flags.py)."""

import os

from absl import flags

from tf_asyncps.app.shared_flags import (filtered_self, is_ctr, job_settings,
                                         quiet_tensorflow)

__all__ = ["cmd_reference"]

FLAGS = flags.FLAGS


def cmd_reference(argv):
    """The job's model trained in this one process: no cluster, no TF_CONFIG.
    Quiet unless --console=full, as launch: a tool run by hand, whose whole
    output is in OUTPUT_DIR_reference/logs."""
    if FLAGS.console != "full":  # the flags are checked here, without TensorFlow
        job_settings()
        out = os.path.normpath(FLAGS.output_dir) + "_reference" if FLAGS.output_dir else None
        return filtered_self("reference", "reference",
                             out and os.path.join(out, "logs"))
    cfg = job_settings()
    cfg.validate()
    quiet_tensorflow()
    if is_ctr():
        from tf_asyncps.app import ctr_job
        return ctr_job.run_reference(cfg)
    from tf_asyncps.app import job
    job.run_reference(cfg)
