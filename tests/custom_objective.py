"""A cost objective registered in one file, as a user would add one: grams of CO2 per 1M tokens at
400 g/kWh, from the draft's and the target's energy together."""
from specbench.plan.costs import draft_energy_j_per_mtok, target_energy_j_per_mtok
from specbench.plan.objectives import Objective, register

GRAMS_PER_KWH = 400.0

register(Objective(
    "carbon", "carbon_g_per_mtok", "g",
    lambda step, prices, power: (draft_energy_j_per_mtok(step, power) + target_energy_j_per_mtok(step, power))
    / 3.6e6 * GRAMS_PER_KWH,
    "grams of CO2 at 400 g/kWh, draft and target together"))
