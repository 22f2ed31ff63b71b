"""Training a composition: its one trainable member, by that member's own method.

``specforge train drafter.name=compose drafter.members=[...]`` trains the member whose drafter
registers a training method (exactly one may), with the member's keys read by that method's own
config model; the others are taken as they are.  The checkpoint is the member's own — it loads,
exports and imports as that drafter's — and the pipeline that serves it is the composition with
that member pointing at it (docs/composition.md#training-a-composition).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, model_validator

from specforge.errors import SectionError
from specforge.toolkit.members import keyed_problems, validation_host
from specforge_plugins.drafters.compose.config import OWN_KEYS, ComposeConfig

__all__ = ["ComposeTraining", "ComposeTrainingConfig"]


class ComposeTrainingConfig(BaseModel):
    """A composition to train: its members as in :class:`ComposeConfig`; the trainable member's
    keys are that drafter's training keys."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["cascade", "tree"] = "cascade"
    members: list[dict[str, Any]] = Field(min_length=1)
    _trained: tuple[int, Any, BaseModel] | None = PrivateAttr(default=None)  # (index, method, its config)

    @model_validator(mode="after")
    def _one_trainable(self, info: ValidationInfo) -> ComposeTrainingConfig:
        host = validation_host(info)
        if host is None:
            return self
        trainable = [i for i, m in enumerate(self.members)
                     if isinstance(m, dict) and m.get("name") in host.names("drafter")
                     and host.get("drafter", m["name"]).metadata.training is not None]
        if len(trainable) != 1:
            found = ", ".join(f"members.{i} ({self.members[i]['name']})" for i in trainable) or "none"
            raise SectionError([("members", f"a composition trains exactly one trainable member; found {found}")])
        i = trainable[0]
        raw = self.members[i]
        method = host.get("drafter", raw["name"]).metadata.training
        # `confidence` is the method's own key when it trains a confidence head (then serving uses
        # that head as the member's estimator); otherwise it is the composition's.
        options = {k: v for k, v in raw.items()
                   if k != "name" and (k not in OWN_KEYS or k in method.config.model_fields)}
        try:
            self._trained = (i, method, method.config.model_validate(options, context={"host": host}))
        except ValidationError as exc:  # the method's own problems, keyed below the member
            raise SectionError(keyed_problems(exc, method.config, f"members.{i}",
                                              owner=f" for training {raw['name']!r}")) from None
        return self


class ComposeTraining:
    """The trainable member's method, with a serving pipeline that is the composition."""

    config = ComposeTrainingConfig

    def __init__(self, config: ComposeTrainingConfig, target: Any, device: Any = "cpu") -> None:
        if config._trained is None:
            raise RuntimeError("compose training: the members are resolved by the plug-in host "
                               "(specforge train validates them)")
        self.settings = config
        self.index, method, options = config._trained
        self.inner = method(options, target, device)
        self.method = self.inner.method
        self.metrics = self.inner.metrics

    @property
    def module(self):
        return self.inner.module

    def needs(self):
        return self.inner.needs()

    def prepare(self, summary) -> None:
        self.inner.prepare(summary)

    def loss(self, outputs, batch):
        return self.inner.loss(outputs, batch)

    def save(self, directory: Path, provenance: dict[str, Any]) -> None:
        self.inner.save(directory, provenance)

    def load(self, directory: Path) -> None:
        self.inner.load(directory)

    def pipeline(self, directory: Path) -> dict[str, Any]:
        """The composition, the trained member serving ``directory`` (with the confidence head its
        method trained, if any), and the correction head it trained for the pipeline's slot."""
        sections = self.inner.pipeline(directory)
        members = [dict(m) for m in self.settings.members]
        trained = dict(sections["drafter"])
        if "confidence" in sections:
            trained["confidence"] = sections["confidence"]
        elif "confidence" in members[self.index]:
            trained["confidence"] = members[self.index]["confidence"]
        members[self.index] = trained
        ComposeConfig.model_validate({"mode": self.settings.mode, "members": members})  # its shape
        out = {"drafter": {"name": "compose", "mode": self.settings.mode, "members": members},
               "confidence": {"name": "reported"}}
        if "correction_head" in sections:
            out["correction_head"] = sections["correction_head"]
        return out
