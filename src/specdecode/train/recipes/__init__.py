"""Drafter training recipes, one module per family: how to build a drafter from the target,
its loss, its predictions aligned with the target's (for validation agreement) and its
export. `RECIPES` maps each `--method` to its recipe; train/drafter.py runs them all through
the one loop (train/loop.py)."""

from __future__ import annotations

from specdecode.train.recipes.base import DrafterRecipe
from specdecode.train.recipes.dflash import DFLASH
from specdecode.train.recipes.draft_model import DRAFT_MODEL
from specdecode.train.recipes.dspark import DSPARK
from specdecode.train.recipes.eagle import EAGLE, EAGLE3
from specdecode.train.recipes.medusa import MEDUSA

RECIPES: dict[str, DrafterRecipe] = {
    "draft_model": DRAFT_MODEL,
    "medusa": MEDUSA,
    "eagle": EAGLE,
    "eagle3": EAGLE3,
    "mtp": EAGLE,  # the MTP drafter class carries its differences (eagle/model.py)
    "dflash": DFLASH,
    "dspark": DSPARK,
}

__all__ = ["RECIPES", "DrafterRecipe"]
