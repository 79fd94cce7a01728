"""tf-asyncps: the command line (absl): ``run`` (the console script) and
``main``, which dispatches to each command's module (launch_cmd.py,
train_cmd.py, server_cmd.py, reference_cmd.py, bench_cmd.py), each beside its
own flags; the flags several commands read: shared_flags.py. What --help
prints: cli_help.py."""

import faulthandler
import os
import signal
import sys

from absl import app, flags, logging

from tf_asyncps.app.launch_cmd import cmd_launch
from tf_asyncps.app.reference_cmd import cmd_reference
from tf_asyncps.app.server_cmd import cmd_server
from tf_asyncps.app.shared_flags import EXIT_LOST_TASK
from tf_asyncps.app.train_cmd import cmd_train

FLAGS = flags.FLAGS
COMMANDS = ("launch", "train", "server", "bench", "reference")

flags.DEFINE_boolean("version", False, "Print tf_asyncps's version, the installed "
                     "TensorFlow/tf_keras/Keras and the supported ranges, then exit.")


def cmd_bench(argv):
    """bench_cmd.cmd_bench; imported here, as bench's flags are only defined for bench."""
    from tf_asyncps.app import bench_cmd  # its flags are defined by run() already
    return bench_cmd.cmd_bench(argv)


def main(argv):
    if FLAGS["version"].value:  # readable unparsed (tests call main directly)
        import tf_asyncps
        from tf_asyncps.compat import versions
        print(versions.describe(tf_asyncps.__version__))
        return
    if not FLAGS["verbosity"].present:
        # Quiet by default (TensorFlow logs cluster set-up at INFO); --verbosity=0 shows it.
        logging.set_verbosity(logging.WARNING)
    if len(argv) < 2 or argv[1] not in COMMANDS or len(argv) > 2:
        # One line, not absl's usage page: the unknown word and what was meant.
        print(f"tf-asyncps: {_command_error(argv[1:])}", file=sys.stderr, flush=True)
        sys.exit(2)
    if argv[1] in ("train", "server"):
        # `kill -USR1 PID` prints every thread's Python stack to the task's
        # stderr (its log under launch) and it runs on: what a stuck task waits on.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        {"launch": cmd_launch, "train": cmd_train, "server": cmd_server,
         "bench": cmd_bench, "reference": cmd_reference}[argv[1]](argv)
    except (ValueError, TimeoutError, RuntimeError) as e:
        # Configuration, connection and data errors: one clear message, no traceback.
        raise SystemExit(f"tf-asyncps {argv[1]}: error: {e}")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the context managers stopped the children
        owner = argv[1] in ("launch", "bench")
        raise SystemExit(f"tf-asyncps {argv[1]}: interrupted"
                         f"{'; every process it started is stopped' if owner else ''}.")
    except Exception as e:  # noqa: BLE001 - only a lost task is rewritten
        lost = _lost_task_message(e, FLAGS.backup_dir)
        if lost is None:
            raise
        print(f"tf-asyncps {argv[1]}: error: {lost}", file=sys.stderr, flush=True)
        sys.exit(EXIT_LOST_TASK)


def _command_error(words) -> str:
    """What a bad command line gets: the unknown word and the nearest commands."""
    import difflib
    usage = f"usage: tf-asyncps {{{'|'.join(COMMANDS)}}} [--flags] (tf-asyncps --help)"
    if not words:
        return f"no command given; {usage}."
    if words[0] not in COMMANDS:
        near = difflib.get_close_matches(words[0], COMMANDS, n=2, cutoff=0.7)
        meant = (f"did you mean {' or '.join(near)}? " if near else "")
        return f"unknown command {words[0]!r}; {meant}{usage}."
    return (f"unexpected arguments {words[1:]} after {words[0]!r}; flags look like "
            f"--name=value; {usage}.")


def _lost_task_message(e: BaseException, backup_dir=None):
    """A one-paragraph message for a task lost mid-training, else None."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(e, (tf.errors.UnavailableError, tf.errors.AbortedError)):
        return None
    import re
    task = re.search(r"/job:(ps|worker)/replica:\d+/task:(\d+)", str(e))
    who = f"{task.group(1)}:{task.group(2)}" if task else "a ps task"
    first = next((ln.strip() for ln in str(e).splitlines() if "UNAVAILABLE" in ln
                  or "Socket closed" in ln or "connect" in ln), type(e).__name__)
    if backup_dir:
        fix = ("restart it and re-run the chief with the same --backup_dir to resume from "
               "the latest checkpoint (launch --restart_failed_tasks does both).")
    else:
        fix = ("restart it and re-run the chief; without --backup_dir there is no "
               "checkpoint, so training starts again from scratch. Pass --backup_dir=DIR "
               "(or use launch --restart_failed_tasks) to resume after such a failure.")
    return f"lost {who} during training ({first}). A ps task's variables die with it: {fix}"


def run():
    """Console-script entry point."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main_module = sys.modules.get("__main__")
    if main_module is not None:  # what --help prints (also for python -m tf_asyncps)
        from tf_asyncps.app.cli_help import help_text
        main_module.__doc__ = help_text()
    args = sys.argv[1:]
    if "bench" in args:
        # bench's 17 --bench_* flags: defined (and in --helpfull) for bench only.
        import tf_asyncps.app.bench_cmd  # noqa: F401
    else:
        stray = [a.split("=")[0] for a in args if a.startswith(("--bench_", "-bench_"))]
        if stray:
            sys.exit(f"tf-asyncps: {stray[0]} is a flag of `tf-asyncps bench` "
                     "(tf-asyncps bench --helpfull lists them).")
    # absl's --help/--helpfull exit with status 1; asking for help is no error.
    for names, short in (({"--help", "-help", "-h", "-?", "--helpshort", "-helpshort"}, True),
                         ({"--helpfull", "-helpfull"}, False)):
        if names.intersection(args):
            from tf_asyncps.app.cli_help import COMMAND_HELP, command_help
            command = next((a for a in args if not a.startswith("-")), None)
            if short and command in {c[0] for c in COMMAND_HELP}:
                sys.stdout.write(command_help(command, FLAGS))  # that command's flags
            else:
                app.usage(shorthelp=short, writeto_stdout=True)
            sys.exit(0)
    app.run(main)


if __name__ == "__main__":
    run()
