"""Datasets: the catalog that names datasets and models, the tabular files a dataset may be,
the shards a training worker reads, and the Ray Data pipelines that prepare streamed splits.

A dataset is a built-in name, a plug-in or an allowed ``package.module:loader`` (arrays in
memory), or a folder or glob of Parquet/CSV files described from their metadata (streamed);
a model is named the same way, by the same catalog. Both are resolved and checked while
parameters are parsed, before any compute. Prepared splits reach each training worker as a
:class:`Shard`: its rows of in-memory arrays, or its Parquet row groups read in small steps,
in a seeded order that every worker and every resumed epoch agrees on.

Behind this face: ``_catalog`` (datasets and models by name: the user contracts of a dataset
loader and a model factory, gradient checkpointing), ``_tabular_files`` (files described from
their metadata), ``_shards`` (in-memory and streamed shards, the split manifest) and
``_streaming`` (Ray Data: statistics and standardised shards of streamed splits).
"""

from prefect_ml.integrations.datasets._catalog import (
    BUILTIN_MODELS,
    DatasetArrays,
    build_mlp,
    build_model,
    check_gradient_checkpointing,
    enable_gradient_checkpointing,
    explicit_parameters,
    import_callable,
    load_dataset,
    resolve_dataset,
    resolve_model,
    taking_float64,
    with_standardizer,
    with_target_scale,
)
from prefect_ml.integrations.datasets._shards import (
    FEATURES,
    LABEL,
    ArrayShard,
    EpochOrder,
    Shard,
    ShardFile,
    ShardReadError,
    StreamedShard,
    epoch_seed,
    open_shard,
    read_manifest,
    shard_bounds,
    table_arrays,
    write_manifest,
)
from prefect_ml.integrations.datasets._streaming import (
    BATCH_ROWS,
    Moments,
    SplitRecipe,
    prepare,
    read_files,
    user_errors,
)
from prefect_ml.integrations.datasets._tabular_files import (
    NUMERIC_TYPES,
    SourceFile,
    TabularSource,
    check_same_columns,
    column_types,
    describe_files,
    describe_source,
    file_format,
    files_digest,
)

__all__ = [
    "BATCH_ROWS",
    "BUILTIN_MODELS",
    "FEATURES",
    "LABEL",
    "NUMERIC_TYPES",
    "ArrayShard",
    "DatasetArrays",
    "EpochOrder",
    "Moments",
    "Shard",
    "ShardFile",
    "ShardReadError",
    "SourceFile",
    "SplitRecipe",
    "StreamedShard",
    "TabularSource",
    "build_mlp",
    "build_model",
    "check_gradient_checkpointing",
    "check_same_columns",
    "column_types",
    "describe_files",
    "describe_source",
    "enable_gradient_checkpointing",
    "epoch_seed",
    "explicit_parameters",
    "file_format",
    "files_digest",
    "import_callable",
    "load_dataset",
    "open_shard",
    "prepare",
    "read_files",
    "read_manifest",
    "resolve_dataset",
    "resolve_model",
    "shard_bounds",
    "table_arrays",
    "taking_float64",
    "user_errors",
    "with_standardizer",
    "with_target_scale",
    "write_manifest",
]
