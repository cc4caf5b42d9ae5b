"""Monte-Carlo step labels from a prover (docs: concepts.md, labels.md), resumable; converters of public data.

Modules: ``format`` (the label columns), ``generators`` (vLLM / Ray back ends), ``hf_generator`` (transformers),
``monte_carlo`` (every-prefix and first-pit labelling), ``store`` (crash-safe parquet shards), ``runner``
(the resumable loop), ``inputs`` (verl parquet / jsonl prompts), ``scoring`` (verl scorers or a user function),
``converters`` (Math-Shepherd, PRM800K), ``closed_form_task`` (a task with exact values: the labelled workload of
``verl-prm bench gpu``), ``cli``.
"""

from verl_prm.labeling.format import LABEL_COLUMNS, LABEL_SCHEMA, best_of_k_from_counts, read_labels
from verl_prm.labeling.generators import Completion, Generator, RayGeneratorPool, VLLMGenerator
from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler

__all__ = [
    "LABEL_COLUMNS",
    "LABEL_SCHEMA",
    "best_of_k_from_counts",
    "read_labels",
    "Completion",
    "Generator",
    "RayGeneratorPool",
    "VLLMGenerator",
    "LabelSettings",
    "MonteCarloLabeler",
]
