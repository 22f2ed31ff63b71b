"""Configuration of the block-drafter backbone shared by DSpark and DFlash (docs/design/drafters.md).

The draft layers copy the *shape* of a target layer (heads, KV heads, head dim, MLP width), so the
config is read off the target's :class:`~specforge.model_args.ModelArgs`; what is the drafter's
own choice is the number of draft layers, the tapped target layers, γ and the block layout.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from specforge.toolkit.drafting import TargetShape, check_draft_vocab_size

__all__ = ["BlockDrafterConfig", "default_tap_layers"]


def default_tap_layers(n_target_layers: int, count: int = 5) -> tuple[int, ...]:
    """``count`` target layers spread evenly from layer 1 to L−3 (DFlash's rule; docs/design/drafters.md).

    Ids are 0-based layer indices whose *output* (the residual stream after that layer) is
    tapped.  Rounding can repeat a layer on shallow targets; repeats are dropped because a
    duplicate tap only widens W_c without adding information.
    """
    lo = min(1, n_target_layers - 1)
    hi = max(lo, n_target_layers - 3)
    if count == 1:
        return ((lo + hi) // 2,)
    ids = (int(round(lo + i * (hi - lo) / (count - 1))) for i in range(count))
    return tuple(dict.fromkeys(ids))


class BlockDrafterConfig(TargetShape):
    """Everything needed to rebuild a backbone (stored as JSON next to its safetensors): the target
    layer's shape, which the draft layers copy (docs/design/drafters.md), then the drafter's own."""

    qk_norm: bool = Field(
        True, description="per-head RMSNorm of the draft layers' queries and keys, whatever the target's layers do: "
                          "the Qwen3 layout DeepSpec, vLLM, SGLang and llama.cpp read (False: not exportable)")
    rope_theta: float = Field(10000.0, description="used only when the target's inv_freq is not shared")

    # --- the drafter's own choices ---
    draft_layers: int = Field(5, ge=1, description="number of draft transformer layers")
    target_layers: tuple[int, ...] | None = Field(
        None, description="tapped target layer ids (0-based outputs); None: 5 spread from 1 to L-3")
    gamma: int = Field(7, ge=1, description="draft positions per block")
    predict_anchor: bool = Field(
        True, description="DSpark: [anchor, MASK×(γ−1)], the anchor slot is the first prediction; "
                          "False (DFlash): [anchor, MASK×γ], predictions at the γ mask slots")
    mask_token_id: int | None = Field(
        None, description="vocabulary id used as MASK (its frozen embedding); None: a learned vector")
    draft_vocab_size: int | None = Field(
        None, ge=1, description="N: the base logits cover a draft vocabulary of N target tokens (its d2t/t2d "
                                "maps travel with the weights); None: the target's whole vocabulary")

    @model_validator(mode="after")
    def _check(self) -> BlockDrafterConfig:
        for layer in self.tap_layers:
            if not 0 <= layer < self.n_target_layers:
                raise ValueError(f"target layer {layer} is outside the target's {self.n_target_layers} layers")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary")
        check_draft_vocab_size(self.draft_vocab_size, self.vocab_size)
        return self

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.target_layers if self.target_layers is not None else default_tap_layers(self.n_target_layers)

    @property
    def block_len(self) -> int:
        """Input slots per block: γ for DSpark, γ+1 for DFlash."""
        return self.gamma if self.predict_anchor else self.gamma + 1

    @property
    def first_prediction(self) -> int:
        """Index of the block slot whose output predicts x_1 (0 for DSpark, 1 for DFlash)."""
        return 0 if self.predict_anchor else 1

    @classmethod
    def from_model_args(cls, args: Any, **overrides: Any) -> BlockDrafterConfig:
        """Target shape from a :class:`ModelArgs`; drafter choices from ``overrides`` (q/k norm on
        unless ``qk_norm=False``: it is the drafter's choice, not the target's)."""
        return cls(**{**cls.target_fields(args), **overrides})
