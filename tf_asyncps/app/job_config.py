"""The jobs' settings and their checks, without TensorFlow.

``JobConfig`` (the digits/MNIST/MovieLens job, ``job.py``) and ``CtrConfig``
(the CTR job, ``ctr_job.py``) hold the flags of the same names. Their
``check()`` needs no TensorFlow, Keras or NumPy import, so the command line
refuses a bad flag before loading TensorFlow; ``validate()`` adds what needs
the package's runtime (the policy's arguments, the Keras 3 version).
``job`` and ``ctr_job`` re-export both classes.
"""

import dataclasses
from typing import Any, Dict, Iterable, Optional, Tuple

from tf_asyncps.app.flag_checks import check_writable_dir
from tf_asyncps.validate import check_int, check_number, is_int

__all__ = ["JobConfig", "CtrConfig", "parse_policy_args", "make_policy", "route_parts",
           "check_flags_apply", "MODELS", "DATASETS", "KERAS", "OPTIMIZERS", "PRECISIONS",
           "REGISTERED_POLICIES", "POLICIES", "CTR_EMBEDDINGS", "CTR_RAW_ID_EMBEDDINGS",
           "TRAIN_EXAMPLES", "POLICY_ARGS", "check_batch_size", "check_policy_args"]

# Equal to models.NAMES, datasets.NAMES, models.KERAS_CHOICES,
# mixed_precision.PRECISIONS, policies.names() and ctr_model.EMBEDDINGS
# (tests/test_cli.py): repeated so that checking them imports no TensorFlow.
MODELS = ("mlp", "linear", "recommender", "dlrm")
DATASETS = ("digits", "mnist", "movielens", "criteo_synthetic")
KERAS = ("tf_keras", "3")
OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad", "rmsprop")
PRECISIONS = ("none", "mixed_float16", "mixed_bfloat16", "auto")
REGISTERED_POLICIES = ("async", "drop_stale", "staleness_aware", "ssp", "dc_asgd",
                       "sync_replicas", "local_sgd")
#: Each registered policy's constructor arguments (tests/test_cli.py keeps
#: them equal to the classes' signatures): an argument a policy does not take
#: is refused without TensorFlow; the values are checked by the policy, after.
POLICY_ARGS = {
    "async": (), "drop_stale": ("max_staleness",), "staleness_aware": ("mode",),
    "ssp": ("max_staleness", "timeout_s"),
    "dc_asgd": ("lambda_", "adaptive", "momentum", "epsilon"),
    "sync_replicas": ("replicas_to_aggregate", "total_num_replicas", "max_staleness",
                      "timeout_s"),
    "local_sgd": ("sync_every", "exchange")}
#: --policy's choices: the registered policies and ``route`` (a policy per part).
POLICIES = REGISTERED_POLICIES + ("route",)
#: Training examples of each data set with a fixed one (datasets.load's
#: splits: digits 1797 less its 20% test, MNIST's 60000, MovieLens's 100,004
#: ratings less the latest 20%); a batch holds at most these.
TRAIN_EXAMPLES = {"digits": 1437, "mnist": 60000, "movielens": 80003}
#: Batches of the CTR job a worker holds at once (2 prefetched, one being
#: made, one in its step): what --batch_size is checked against memory with.
CTR_BATCHES_HELD = 4
#: The CTR job's numeric and categorical features (ctr_data.NUM_DENSE, len(CRITEO_KAGGLE)).
CTR_DENSE, CTR_SPARSE = 13, 26
CTR_EMBEDDINGS = ("tables", "offset", "collection", "dynamic", "dynamic_collection")
CTR_RAW_ID_EMBEDDINGS = ("dynamic", "dynamic_collection")

_CTR_JOB = "the CTR job (--model=dlrm --dataset=criteo_synthetic, configs/ctr.flags)"
_ROUTE_PARTS = ("sparse", "dense")
_ROUTE_HOW = ("write e.g. --policy=route --policy_args=sparse=async,dense=local_sgd,"
              "dense.sync_every=16 (each part: a policy name; its arguments as "
              "PART.NAME=VALUE; sparse_names=REGEX picks the sparse part's variables, "
              "default 'embeddings'; Python: tf_asyncps.policies.route)")


@dataclasses.dataclass
class JobConfig:
    """Settings of one training job (the CLI flags of the same names).

    Units: ``epochs`` and ``steps_per_epoch`` count worker steps (one batch of
    ``batch_size`` examples on one worker); times are seconds.
    """

    model: str = "mlp"
    dataset: str = "digits"
    epochs: int = 10
    steps_per_epoch: int = 100
    batch_size: int = 32
    learning_rate: float = 0.1
    optimizer: str = "sgd"
    policy: str = "async"
    policy_args: Dict[str, Any] = dataclasses.field(default_factory=dict)
    hidden: Tuple[int, ...] = (128,)
    seed: int = 0
    output_dir: Optional[str] = None
    steps_per_execution: int = 1
    connect_timeout_s: float = 30.0
    max_tracked_staleness: int = 32
    locking: bool = False
    mixed_precision: str = "none"  # none, mixed_float16, mixed_bfloat16, auto
    wire_dtype: str = "float32"  # or "bfloat16": AsyncParameterServerStrategy(wire_dtype=)
    backup_dir: Optional[str] = None  # epoch or step backups: resume after a crash
    # > 0: StepBackup every that many worker steps (mid-epoch resume) instead.
    backup_every_steps: int = 0
    embedding_dim: int = 32  # recommender: width of each embedding table
    # variable_partitioner: MinSizePartitioner(min_shard_bytes, max_shards=num_ps);
    # 0 keeps every variable whole.
    min_shard_bytes: int = 0
    num_workers: int = 0  # informational: taken from the cluster
    num_ps: int = 0
    keras: str = "tf_keras"  # "tf_keras" or "3" (Keras 3: tf_asyncps/keras3)
    # recommender: raw ids into DynamicEmbedding tables of dynamic_capacity x
    # (the column's distinct ids) rows, an eviction pass every dynamic_evict_every
    # global steps.
    dynamic_ids: bool = False
    dynamic_capacity: float = 0.7
    dynamic_evict_every: int = 20

    def validate(self) -> None:
        """:meth:`check`, then the checks that import the package's runtime
        (TensorFlow): the policy and its arguments, the Keras 3 version,
        local steps beside loss scaling.

        Raises:
          ValueError: naming the first bad field and its valid range.
        """
        self.check()
        if self.keras == "3":
            from tf_asyncps.keras3.trainer import unsupported_version
            message = unsupported_version()
            if message:
                raise ValueError(f"--keras=3: {message}")
        from tf_asyncps.core import mixed_precision
        policy = make_policy(self.policy, self.policy_args)
        mixed_precision.check_local_copies(policy, precision=self.mixed_precision)

    def check(self) -> None:
        """The checks that need no TensorFlow (the command line runs them
        before importing it): each field's type, range and choices.

        Raises:
          ValueError: naming the first bad field and its valid range.
        """
        for name in ("epochs", "steps_per_epoch", "batch_size", "steps_per_execution",
                     "embedding_dim", "dynamic_evict_every", "max_tracked_staleness"):
            check_int(getattr(self, name), f"--{name}", min=1)
        check_batch_size(self)
        if not self.hidden or any(not is_int(h) or h < 1 for h in self.hidden):
            raise ValueError(f"--hidden must be layer sizes >= 1 (e.g. --hidden=128,64), got "
                             f"{list(self.hidden)!r}.")
        # scikit-learn's and NumPy's random_state take [0, 2**32).
        check_int(self.seed, "--seed", min=0, below=2 ** 32,
                  hint="the seed of the data split, initialisation and shuffling")
        check_number(self.learning_rate, "--learning_rate", above=0)
        check_number(self.connect_timeout_s, "--connect_timeout_s", above=0, hint="seconds")
        for name, choices in (("optimizer", OPTIMIZERS), ("model", MODELS),
                              ("dataset", DATASETS), ("keras", KERAS),
                              ("mixed_precision", PRECISIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"--{name}={getattr(self, name)!r} is unknown; choose one "
                                 f"of {list(choices)}.")
        if (self.model == "recommender") != (self.dataset == "movielens"):
            raise ValueError(
                f"--model={self.model} does not fit --dataset={self.dataset}: "
                "--model=recommender needs the id columns of --dataset=movielens, and "
                "movielens needs --model=recommender.")
        if (self.model == "dlrm") != (self.dataset == "criteo_synthetic"):
            raise ValueError(
                f"--model={self.model} does not fit --dataset={self.dataset}: the CTR job is "
                "--model=dlrm --dataset=criteo_synthetic (configs/ctr.flags).")
        self._check_dynamic()
        check_int(self.min_shard_bytes, "--min_shard_bytes", min=0,
                  hint="0: no variable_partitioner")
        check_int(self.backup_every_steps, "--backup_every_steps", min=0, below=2 ** 63,
                  hint="0: epoch-end backups")
        if self.backup_every_steps and self.backup_dir is None:
            raise ValueError("--backup_every_steps needs --backup_dir=DIR (where the backups "
                             "go; launch defaults it to OUTPUT_DIR/backup).")
        if self.backup_dir is not None:
            check_writable_dir(
                self.backup_dir, "--backup_dir", "checkpoints",
                if_empty="leave the flag out for none (launch --restart_failed_tasks then "
                         "uses OUTPUT_DIR/backup)")
        if self.output_dir:
            check_writable_dir(self.output_dir, "--output_dir",
                               "metrics.json, logs and the SavedModel")
        if self.wire_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--wire_dtype must be float32 or bfloat16, got {self.wire_dtype!r}.")
        _check_policy_names(self.policy, self.policy_args)

    def _check_dynamic(self) -> None:
        """--dynamic_ids needs the recommender, tf_keras and a capacity > 0."""
        if not self.dynamic_ids:
            return
        if self.model != "recommender":
            raise ValueError("--dynamic_ids feeds raw user and movie ids into DynamicEmbedding "
                             "tables: it needs --model=recommender --dataset=movielens.")
        if self.keras != "tf_keras":
            raise ValueError("--dynamic_ids needs --keras=tf_keras (tf_asyncps.layers."
                             "DynamicEmbedding is a tf_keras layer).")
        check_number(self.dynamic_capacity, "--dynamic_capacity", above=0,
                     hint="rows of each table as a fraction of its column's distinct ids, "
                          "e.g. 0.7; >= 1 gives every id a row")


@dataclasses.dataclass
class CtrConfig(JobConfig):
    """The main job's settings plus the CTR data's and model's (the
    ``--ctr_*`` flags). ``embedding_dim`` is the rows' width; ``hidden`` is
    unused (``ctr_top_mlp`` is the top MLP)."""

    model: str = "dlrm"
    dataset: str = "criteo_synthetic"
    optimizer: str = "adagrad"
    embedding_dim: int = 16
    ctr_max_rows: int = 1_000_000
    ctr_scale: float = 1.0
    ctr_zipf: float = 1.1
    ctr_embedding: str = "tables"
    ctr_bottom_mlp: Tuple[int, ...] = (64,)
    ctr_top_mlp: Tuple[int, ...] = (256, 128)
    ctr_test_examples: int = 65536

    def rows(self) -> Tuple[int, ...]:
        """Rows of each of the 26 tables (``ctr_data.table_rows``)."""
        from tf_asyncps.app import ctr_data
        return ctr_data.table_rows(self.ctr_max_rows, self.ctr_scale)

    def check(self) -> None:
        """:meth:`JobConfig.check` and the CTR fields' checks (no TensorFlow).

        Raises:
          ValueError: naming the first bad field and its valid range.
        """
        if self.dynamic_ids:
            raise ValueError("--dynamic_ids is the recommender's; the CTR job's raw-id "
                             "variant is --ctr_embedding=dynamic.")
        super().check()
        if (self.model, self.dataset) != ("dlrm", "criteo_synthetic"):
            raise ValueError(f"the CTR job is --model=dlrm --dataset=criteo_synthetic, got "
                             f"--model={self.model} --dataset={self.dataset}.")
        # ctr_data.table_rows's checks, in its words.
        check_int(self.ctr_max_rows, "--ctr_max_rows", min=1, hint="rows per feature at most")
        if not (isinstance(self.ctr_scale, (int, float)) and 0 < self.ctr_scale <= 1):
            raise ValueError(f"--ctr_scale must be in (0, 1] (a fraction of each feature's "
                             f"rows), got {self.ctr_scale!r}.")
        if self.ctr_embedding not in CTR_EMBEDDINGS:
            raise ValueError(f"--ctr_embedding={self.ctr_embedding!r} is unknown; choose one "
                             f"of {list(CTR_EMBEDDINGS)}.")
        for name in ("ctr_bottom_mlp", "ctr_top_mlp"):
            sizes = getattr(self, name)
            if any(not is_int(h) or h < 1 for h in sizes):
                raise ValueError(f"--{name} must be layer sizes >= 1 (e.g. --{name}=256,128), "
                                 f"got {list(sizes)!r}.")
        if not self.ctr_top_mlp:
            raise ValueError("--ctr_top_mlp needs at least one layer size (e.g. 256,128).")
        check_int(self.ctr_test_examples, "--ctr_test_examples", min=2)
        check_number(self.ctr_zipf, "--ctr_zipf", min=0, below=float("inf"),
                     hint="the Zipf exponent of the ids; Criteo-like: 1.1")
        if self.ctr_embedding in CTR_RAW_ID_EMBEDDINGS:
            check_number(self.dynamic_capacity, "--dynamic_capacity", above=0,
                         hint="rows of each table as a fraction of its feature's ids")

    def summary(self, data) -> Dict[str, Any]:
        from tf_asyncps.app import ctr_data
        return {**ctr_data.summary(data), "embedding": self.ctr_embedding,
                "embedding_dim": self.embedding_dim, "bottom_mlp": list(self.ctr_bottom_mlp),
                "top_mlp": list(self.ctr_top_mlp), "test_examples": self.ctr_test_examples}


def check_batch_size(cfg: JobConfig, available_mb: Any = "meminfo") -> None:
    """Refuses a ``--batch_size`` no worker can make: more than the training
    examples of a fixed data set (:data:`TRAIN_EXAMPLES`; the repeated
    dataset would fill a batch with copies until the worker runs out of
    memory), or, for the CTR job's endless stream, :data:`CTR_BATCHES_HELD`
    batches (inputs, ids and their looked-up float32 rows) beyond this
    host's available memory.

    Args:
      cfg: the job's settings (``batch_size`` >= 1 checked before).
      available_mb: this host's available memory in MB (None: unknown, no
        memory check); default: MemAvailable of /proc/meminfo.

    Raises:
      ValueError: naming --batch_size, the bound and why.
    """
    n = cfg.batch_size
    if cfg.dataset in TRAIN_EXAMPLES:
        most = TRAIN_EXAMPLES[cfg.dataset]
        if n > most:
            raise ValueError(
                f"--batch_size={n} is more than the {most} training examples of "
                f"--dataset={cfg.dataset} (a batch would repeat them); use --batch_size="
                f"{most} or less.")
        return
    if available_mb == "meminfo":
        from tf_asyncps.cluster.devices import available_memory_mb
        available_mb = available_memory_mb()
    if cfg.dataset != "criteo_synthetic" or available_mb is None:
        return
    per_example = 4 * CTR_DENSE + CTR_SPARSE * (8 + 4 * cfg.embedding_dim)
    most = int(available_mb * 2 ** 20 // (CTR_BATCHES_HELD * per_example))
    if n > most:
        raise ValueError(
            f"--batch_size={n}: a CTR example holds {per_example} bytes ("
            f"{CTR_DENSE} float32 counts, {CTR_SPARSE} ids and their rows of "
            f"--embedding_dim={cfg.embedding_dim} float32), a worker holds "
            f"{CTR_BATCHES_HELD} batches: {CTR_BATCHES_HELD * n * per_example / 2 ** 30:.1f} "
            f"GiB, but this host has {available_mb / 1024:.1f} GiB available (MemAvailable); "
            f"use --batch_size={most} or less.")


def parse_policy_args(text: str) -> Dict[str, Any]:
    """Parses ``"k=v,k2=v2"`` into a dict; values become int, float, bool or str.

    Raises:
      ValueError: an item without ``=`` (naming the item and the format); a
        key given twice (naming it: which value was meant is unknown).
    """
    out = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(
                f"--policy_args item {item!r} is not key=value; write e.g. "
                "--policy_args=max_staleness=2,mode=inverse.")
        if key in out:
            raise ValueError(
                f"--policy_args gives {key!r} twice ({text!r}); give each "
                "argument once.")
        val = val.strip()
        low = val.lower()
        if low in ("true", "false"):
            parsed = low == "true"
        else:
            try:
                parsed = int(val)
            except ValueError:
                try:
                    parsed = float(val)
                except ValueError:
                    parsed = val
        out[key] = parsed
    return out


def route_parts(args: Dict[str, Any]):
    """``--policy=route``'s ``--policy_args`` as ``({part: (policy name,
    its arguments)}, sparse_names)`` for ``sparse`` and ``dense`` (each
    ``async`` unless given; ``PART.NAME=VALUE`` is an argument of the part's
    policy; ``sparse_names``: None for route's default).

    Raises:
      ValueError: an unknown key or part policy (the message says how to
        write the flag).
    """
    parts = {p: [args.get(p, "async"), {}] for p in _ROUTE_PARTS}
    for key, value in args.items():
        part, dot, name = key.partition(".")
        if key in _ROUTE_PARTS or key == "sparse_names":
            continue
        if not dot or part not in _ROUTE_PARTS or not name:
            raise ValueError(f"--policy=route takes no argument {key!r}; {_ROUTE_HOW}.")
        parts[part][1][name] = value
    for part, (policy, _) in parts.items():
        if policy not in REGISTERED_POLICIES:
            raise ValueError(f"--policy=route: {part}={policy!r} is not a policy; choose one "
                             f"of {list(REGISTERED_POLICIES)}; {_ROUTE_HOW}.")
    names = args.get("sparse_names")
    if names is not None and (not isinstance(names, str) or not names):
        raise ValueError(f"--policy=route: sparse_names must be a regular expression, got "
                         f"{names!r}.")
    return {p: (n, kw) for p, (n, kw) in parts.items()}, names


def check_policy_args(policy: str, args: Dict[str, Any]) -> None:
    """Refuses an argument that the registered policy ``policy`` does not
    take (:data:`POLICY_ARGS`), without TensorFlow.

    Raises:
      ValueError: naming the policy, the argument and the ones it takes.
    """
    takes = POLICY_ARGS[policy]
    bad = sorted(set(args) - set(takes))
    if bad:
        which = (f"it takes {', '.join(takes)}" if takes else "it takes none")
        raise ValueError(f"bad arguments for policy {policy!r}: {', '.join(map(repr, bad))} "
                         f"is not one of its arguments; {which} (docs/concepts/policies.md).")


def _check_policy_names(policy: str, args: Dict[str, Any]) -> None:
    if policy not in POLICIES:
        raise ValueError(f"--policy={policy!r} is unknown; choose one of {list(POLICIES)}.")
    if policy != "route":
        return check_policy_args(policy, args)
    for part, (name, kwargs) in route_parts(args)[0].items():
        try:
            check_policy_args(name, kwargs)
        except ValueError as e:
            raise ValueError(f"--policy=route: {part}={name}: {e}") from None


def make_policy(policy: str, args: Dict[str, Any]):
    """The UpdatePolicy of ``--policy`` and ``--policy_args`` (``route``: one
    policy per part, :func:`route_parts`). Imports the package's runtime.

    Raises:
      ValueError: an unknown policy or arguments it does not take or rejects.
    """
    from tf_asyncps import policies
    if policy != "route":
        return policies.get(policy, **args)
    parts, sparse_names = route_parts(args)
    made = {}
    for part, (name, kwargs) in parts.items():
        try:
            made[part] = policies.get(name, **kwargs)
        except ValueError as e:
            raise ValueError(f"--policy=route: {part}={name}: {e}") from None
    return policies.route(sparse=made["sparse"], dense=made["dense"],
                          sparse_names=sparse_names)


#: Flags only one job reads: flag -> (the job, what the others use instead).
_ONE_JOB_FLAGS = {
    "hidden": ("the mlp and recommender jobs", "the CTR job's MLPs are --ctr_bottom_mlp "
               "and --ctr_top_mlp"),
    "dynamic_ids": ("the recommender job (--model=recommender --dataset=movielens)",
                    "the CTR job's raw-id tables are --ctr_embedding=dynamic"),
}


def check_flags_apply(cfg: JobConfig, given: Iterable[str]) -> None:
    """Refuses a flag given for a job that does not read it (it would be
    ignored silently): a ``--ctr_*`` flag off the CTR job, ``--hidden`` or
    ``--dynamic_ids`` on it, ``--embedding_dim`` on the mlp/linear model,
    ``--dynamic_capacity``/``--dynamic_evict_every`` without dynamic tables.

    Args:
      cfg: the job's settings.
      given: names of the flags given (command line or flagfile).

    Raises:
      ValueError: naming the first such flag, the job it belongs to and the fix.
    """
    ctr = isinstance(cfg, CtrConfig)
    job = f"the {cfg.model} job on --dataset={cfg.dataset}"
    for flag in sorted(given):
        if flag.startswith("ctr_") and not ctr:
            raise ValueError(f"--{flag} is a flag of {_CTR_JOB}; {job} does not read it: "
                             "drop it, or add --flagfile=configs/ctr.flags.")
        if ctr and flag in _ONE_JOB_FLAGS:
            owner, instead = _ONE_JOB_FLAGS[flag]
            raise ValueError(f"--{flag} is a flag of {owner}; {instead}.")
        if flag == "embedding_dim" and cfg.model in ("mlp", "linear"):
            raise ValueError(f"--embedding_dim is a flag of the recommender and CTR jobs "
                             f"(their tables' width); {job} has no embedding tables: drop it.")
        if flag in ("dynamic_capacity", "dynamic_evict_every"):
            dynamic = cfg.ctr_embedding in CTR_RAW_ID_EMBEDDINGS if ctr else cfg.dynamic_ids
            if not dynamic:
                raise ValueError(
                    f"--{flag} sizes the dynamic tables of --dynamic_ids (recommender) or "
                    f"--ctr_embedding=dynamic|dynamic_collection (CTR job); {job} has "
                    "none: drop it or add one of those.")

