"""``tf-asyncps train``: one binary for every role; reads TF_CONFIG, ps and
worker tasks serve (server_cmd.py), the chief trains the job. Its flags: the
job's and --console, --gpus (shared_flags.py), --allow_foreign_address
(server_cmd.py)."""

from tf_asyncps.app.server_cmd import apply_gpus_flag, filtered_task, serve, startup_checks
from tf_asyncps.app.shared_flags import is_ctr, job_settings, quiet_console, quiet_tensorflow

__all__ = ["cmd_train"]


def cmd_train(argv):
    from tf_asyncps import cluster
    config = cluster.tf_config_from_env()
    if quiet_console():
        return filtered_task(config, "train")
    startup_checks(config)
    apply_gpus_flag()
    if config.task_type in ("ps", "worker"):
        return serve(config)
    cfg = job_settings()
    cfg.validate()
    quiet_tensorflow()
    if is_ctr():
        from tf_asyncps.app import ctr_job
        return ctr_job.run(cfg, cluster.cluster_resolver(config))
    from tf_asyncps.app import job
    job.run(cfg, cluster.cluster_resolver(config))
