"""verl-prm: dense process advantages for verl (the PAV method, Setlur et al. 2024).

Importing this package does not import verl; `verl_prm.integrations.verl.plugin` (loaded by verl's "verl.plugins" entry point)
registers the estimators and the other verl components.
"""

__version__ = "0.1.0"
SUPPORTED_VERL_VERSION = "0.9.1"
