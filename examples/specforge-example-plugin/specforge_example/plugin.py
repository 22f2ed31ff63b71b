"""Two third-party components, registered exactly as specforge's own are: a scheduler, and a
drafter that ``specforge train`` can train (:mod:`specforge_example.hidden_head`).

``budget`` caps the number of draft tokens the target verifies per round across the whole batch
— useful when a serving stack gives speculation a fixed slice of every forward pass.  The budget
is spent on the (request, position) pairs with the highest prefix survival a_{r,j} = Π_{i≤j} c_i.

Why it is lossless: a_{r,j} depends on x_<j only (confidences are pre-token), and a request's
later positions never rank above its earlier ones (a is non-increasing in j, ties go to the
smaller j), so whether x_j is verified never depends on x_j or anything after it.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from specforge import hookimpl
from specforge_example.hidden_head import HiddenHeadConfig, HiddenHeadDrafter, HiddenHeadTraining


class BudgetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: int = Field(8, ge=0, description="draft tokens verified per round, whole batch")


class BudgetScheduler:
    def __init__(self, config: BudgetConfig) -> None:
        self.tokens = config.tokens

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        r, g = confidence.shape
        survival = torch.cumprod(confidence.double(), dim=1)
        position = torch.arange(g).expand(r, g)
        eligible = (position < available.view(r, 1)) & (survival > 0)
        survival = torch.where(eligible, survival, torch.full_like(survival, -1.0))
        # Sort by survival descending, then position, then request: a stable sort on a key that
        # is already in (request, position) order does exactly that.
        order = torch.sort(survival.flatten(), descending=True, stable=True).indices
        chosen = order[: min(self.tokens, int(eligible.sum()))]
        lengths = torch.zeros(r, dtype=torch.long)
        if chosen.numel():
            rows, cols = chosen // g, chosen % g
            lengths.scatter_reduce_(0, rows, cols + 1, reduce="amax")
        return lengths


@hookimpl
def specforge_register_schedulers(register):
    register(
        "budget",
        BudgetScheduler,
        config=BudgetConfig,
        reads=["confidence"],
        description="verify the N most likely-to-survive draft tokens of the batch",
    )


@hookimpl
def specforge_register_drafters(register):
    register(
        "hidden-head",
        HiddenHeadDrafter,
        config=HiddenHeadConfig,
        training=HiddenHeadTraining,  # what makes `specforge train drafter.name=hidden-head` work
        provides=["probs", "logits"],
        examples=[{}, {"seed": 1}],
        description="one linear layer over the target's last hidden state and the anchor; drafts 1 token",
    )
