"""The data each trial trains on: the campaign's, or the splits prepared for the dataset
options its search space drew (``dataset_options.<key>``).

Splits are prepared as :func:`~prefect_ml.tasks.data.preprocess` prepares them (named by their
content's fingerprint in the storage, so the final training of a pipeline finds them too),
once per distinct options in a campaign however many trials draw them. The study remembers
which fingerprint each options' recipe gave, so a resumed campaign reuses those splits without
calling the loader again. A campaign whose space sets no dataset option trains every trial on
its own prepared data and does none of this.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.config.data import DataParams
from prefect_ml.integrations.config.sweep import DATASET_OPTION
from prefect_ml.tasks.data import Logger, PreparedData, prepare_data, prepared_splits

if TYPE_CHECKING:
    import optuna

# A study's user attribute per recipe a trial drew: ``prefect_ml.dataset.<recipe key>`` ->
# the fingerprint of the splits prepared for it.
PREPARED_ATTR = "prefect_ml.dataset."


def tunes_data(values: Mapping[str, Any]) -> bool:
    """Whether a trial's values set an option of the dataset loader."""
    return any(name.startswith(DATASET_OPTION) for name in values)


def recipe_key(data: DataParams) -> str:
    """The identity of a data section: what is loaded and how it is split, as a short hash."""
    recipe = data.model_dump(mode="json")
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


class TrialDatasets:
    """The prepared data of each recipe the campaign's trials train on; safe to use from the
    coordinator's threads (one recipe is prepared at a time)."""

    def __init__(self, data: PreparedData, recipe: DataParams, storage_url: str) -> None:
        self.storage_url = storage_url
        self._prepared = {recipe_key(recipe): data}  # the campaign's own data, by its recipe
        self._lock = threading.Lock()

    def for_recipe(self, recipe: DataParams, study: optuna.Study, logger: Logger) -> PreparedData:
        """The splits of ``recipe`` (a trial's data section): prepared once, then shared."""
        key = recipe_key(recipe)
        with self._lock:
            found = self._prepared.get(key)
            if found is None:
                found = self._prepared[key] = self._prepare(recipe, key, study, logger)
        return found

    def _prepare(
        self, recipe: DataParams, key: str, study: optuna.Study, logger: Logger
    ) -> PreparedData:
        fingerprint = study.user_attrs.get(PREPARED_ATTR + key)
        if fingerprint is not None:  # an earlier run of the campaign prepared it
            found = prepared_splits(fingerprint, self.storage_url, logger)
            if found is not None:
                return found.model_copy(update={"recipe": recipe})
        logger.info("Preparing the data of dataset options %s", recipe.dataset_options)
        prepared = prepare_data(recipe, self.storage_url, logger)
        study.set_user_attr(PREPARED_ATTR + key, prepared.fingerprint)
        return prepared
