"""Training configuration (docs/training.md): one pydantic model, composed from presets, YAML and dot-lists.

A run is ``preset or YAML file(s)`` + ``key=value`` overrides, merged by OmegaConf and validated
once; every problem is reported together, naming the key path and the valid keys (the same
:class:`~specforge.errors.ConfigError` as pipeline configs)::

    load_train_config("quick", ["optimizer.lr=3e-4", "drafter.head.name=gated"])

Presets: ``quick`` is the README's ~10-minute main job on 2 CPU cores (a small ShareGPT subset,
2-layer DSpark, γ=7, short sequences); ``full`` is the paper-like profile (all of ShareGPT, longer
sequences, 5 layers, several epochs).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specforge.config import TargetConfig, compose, merge_layer
from specforge.errors import ConfigError, validation_problems
from specforge.registry import ComponentKind

__all__ = ["PRESETS", "TrainConfig", "TrainConfigError", "load_train_config", "train_preset_names"]


class TrainConfigError(ConfigError):
    """A training config that cannot be used; lists every problem (a :class:`ConfigError`, so the
    CLI's exit-status-2 handling applies)."""

    def __init__(self, problems: list[str], source: str = "") -> None:
        self.problems = problems
        where = f" ({source})" if source else ""
        ValueError.__init__(self, f"invalid training config{where}:\n" + "\n".join(f"  {p}" for p in problems))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegenerateConfig(_Section):
    """Replace the dataset's answers by the target's own (docs/data.md) before training."""

    enabled: bool = Field(False, description="answer the user turns with the target first")
    turns: Literal["first", "all"] = Field("first", description="answer only the first user turn, or every turn")
    max_new_tokens: int = Field(256, ge=1, description="tokens per answer")
    max_batch: int = Field(16, ge=1, description="conversations decoded together")
    shard_size: int = Field(64, ge=1, description="conversations per output shard (the resume unit)")
    seed: int = Field(0, description="base seed of the answers' sampling")
    # None takes the checkpoint's generation_config (and with none there, the target's own law:
    # T = 1, no truncation); set them when the recommendation lives only on the model card.
    temperature: float | None = Field(None, ge=0, description="sampling temperature; None: the target's recommendation")
    top_k: int | None = Field(None, ge=0, description="top-k (0: off); None: the target's recommendation")
    top_p: float | None = Field(None, gt=0, le=1, description="top-p; None: the target's recommendation")
    dir: str | None = Field(None, description="output directory; None: <output.dir>/regenerated")


class DataConfig(_Section):
    source: str = Field("sharegpt", description="'sharegpt' (the installed wheel) or a JSONL file of conversations")
    limit: int | None = Field(None, ge=1, description="first N conversations; None: all")
    max_length: int = Field(512, ge=8, description="tokens kept per conversation (its start)")
    eval_sequences: int = Field(0, ge=0, description="sequences held out (from the end) for eval")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)


class FeaturesConfig(_Section):
    mode: Literal["offline", "online"] = "offline"
    cache_dir: str | None = Field(None, description="offline cache; None: <output.dir>/features")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="stored dtype; None: the target's")
    sequences_per_shard: int = Field(64, ge=1)
    shuffle_window: int = Field(4, ge=1, description="shards whose sequences are shuffled together (offline)")


class DrafterSection(BaseModel):
    """``name``: a registered drafter with a training method; every other key is that method's
    (validated against its ``config`` model once the plug-ins are loaded)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field("dspark", description="the drafter to train (one registered with training=...)")

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class OptimizerConfig(_Section):
    lr: float = Field(6e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0, description="on matrices only; norms, biases and vectors are not decayed")


class ScheduleConfig(_Section):
    warmup_steps: int = Field(20, ge=0)
    total_steps: int | None = Field(None, ge=1, description="give this or epochs")
    epochs: float | None = Field(None, gt=0)
    min_lr: float = Field(6e-5, ge=0, description="the cosine ends here")

    @model_validator(mode="after")
    def _one_length(self) -> ScheduleConfig:
        if (self.total_steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of total_steps and epochs")
        return self


class BatchConfig(_Section):
    sequences: int = Field(8, ge=1, description="sequences per optimizer step (global, over all ranks)")
    anchors: int = Field(16, ge=1, description="anchors (draft blocks) sampled per sequence")
    memory_check: bool = Field(True, description="before the first step, measure what a step takes on a CPU and "
                                                 "refuse one that would not fit in the memory available")


class OutputConfig(_Section):
    dir: str = Field("runs/train", description="checkpoints/, metrics.jsonl and the feature cache by default")
    checkpoint_interval: int = Field(100, ge=1, description="steps between checkpoints (one more at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept; older ones are deleted")
    eval_interval: int | None = Field(None, ge=1, description="steps between evals on held-out data")
    log_interval: int = Field(1, ge=1, description="steps between metrics.jsonl lines")
    progress: bool = True


class TrainConfig(_Section):
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    features: FeaturesConfig = Field(default_factory=FeaturesConfig)
    drafter: DrafterSection = Field(default_factory=DrafterSection)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=lambda: ScheduleConfig(total_steps=300))
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm; None: no clipping")
    batch: BatchConfig = Field(default_factory=BatchConfig)
    seed: int = Field(0, description="data order and anchor sampling")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="autocast dtype of the drafter forward (weights stay float32); auto: bfloat16 on "
                            "CUDA; on a CPU the precision target.dtype=auto measured fastest for prompt-sized "
                            "passes (bf16 with AMX, float32 where bf16 is emulated), float32 when the target's "
                            "dtype is explicit")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool | None = Field(
        None, description="torch.compile the loss (fuses its passes over the [blocks, γ, V] tensors; "
                          "about a minute to compile); None: only for vocabularies of 8192 or more")
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="before")
    @classmethod
    def _loss_moved(cls, raw: Any) -> Any:
        """Configs (and checkpoints) from before training was a plug-in contract kept DSpark's
        loss weights in a top-level ``loss`` section; they now belong to the method."""
        if isinstance(raw, dict) and isinstance(raw.get("loss"), dict):
            raw = dict(raw)
            drafter = dict(raw.get("drafter") or {})
            drafter["loss"] = {**raw.pop("loss"), **drafter.get("loss", {})}
            raw["drafter"] = drafter
        return raw

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def training_method(self) -> tuple[Any, BaseModel]:
        """The drafter's registered training method and its validated ``drafter.*`` config."""
        return _resolve_drafter(self.drafter)


# What every preset shares: SmolLM2 (in the precision measured fastest here) answering ShareGPT itself, a bf16 offline cache and
# a DSpark drafter with γ = 7, the Markov head and the confidence head (rank 256, docs/design/drafters.md).
_COMMON: dict[str, Any] = {
    "target": {"model": "smollm2", "dtype": "auto"},
    "data": {"source": "sharegpt", "regenerate": {"enabled": True, "turns": "first"}},
    "features": {"mode": "offline", "dtype": "bfloat16", "sequences_per_shard": 64},
    "drafter": {"name": "dspark", "layers": 2, "gamma": 7, "head": {"name": "markov", "rank": 256},
                "confidence": {"name": "dspark-head", "rank": 256}},
    # 2e-3 and a small initial output norm: in a 24-step A/B on the quick data (held-out τ̂ 1.30
    # vs 1.20 for 6e-4 with unit norm weights) — short runs need the fast start.
    "optimizer": {"lr": 2e-3},
    "schedule": {"warmup_steps": 20, "epochs": 4, "min_lr": 1e-4},
    "batch": {"sequences": 8, "anchors": 16},
}

_DIFFERENCES: dict[str, dict[str, Any]] = {
    # The main job's budget (README): ~10 min on 2 cores (Xeon, AMX) for data, features, training and eval.
    "quick": {
        "data": {"limit": 192, "max_length": 384, "eval_sequences": 8,
                 "regenerate": {"max_new_tokens": 192, "max_batch": 16}},
        "output": {"dir": "runs/quick", "checkpoint_interval": 50, "eval_interval": 50},
    },
    # About an hour on 2 cores: enough of the target's own answers for the drafter to pick up
    # its style, still the cheap 2-layer backbone.
    "medium": {
        "data": {"limit": 640, "max_length": 448, "eval_sequences": 16,
                 "regenerate": {"max_new_tokens": 256, "max_batch": 32}},
        "output": {"dir": "runs/medium", "checkpoint_interval": 50, "eval_interval": 50},
    },
    # The drafter shipped for SmolLM2 on 2 CPU cores, trained for hours: ~4,000 of the target's own
    # answers, a draft vocabulary of the 8,192 tokens it writes most (the LM head and the heads'
    # tables shrink 6×, so a step and a draft position cost less), checkpoints and held-out τ̂
    # every 100 steps so the run can be stopped, resumed and plotted against CPU-hours.
    "cpu": {
        "data": {"limit": 4000, "max_length": 512, "eval_sequences": 32,
                 "regenerate": {"max_new_tokens": 256, "max_batch": 16, "shard_size": 128}},
        "features": {"sequences_per_shard": 128},
        "drafter": {"draft_vocab": 8192, "confidence": {"embedding": "head"}},
        "schedule": {"warmup_steps": 50, "epochs": 6, "min_lr": 1e-4},
        "batch": {"sequences": 16, "anchors": 16},
        "output": {"dir": "runs/cpu", "checkpoint_interval": 100, "eval_interval": 100},
    },
    # Paper-like: all of ShareGPT, every turn answered, 5 layers, longer sequences.
    "full": {
        "data": {"limit": None, "max_length": 1024, "eval_sequences": 64,
                 "regenerate": {"turns": "all", "max_new_tokens": 512, "max_batch": 32, "shard_size": 256}},
        "features": {"sequences_per_shard": 256},
        "drafter": {"layers": 5},
        "optimizer": {"lr": 1e-3},
        "schedule": {"warmup_steps": 200, "epochs": 3},
        "batch": {"sequences": 16, "anchors": 32},
        "output": {"dir": "runs/full", "checkpoint_interval": 500, "eval_interval": 500},
    },
}

PRESETS: dict[str, dict[str, Any]] = {
    name: OmegaConf.to_container(OmegaConf.merge(_COMMON, diff))  # type: ignore[misc]
    for name, diff in _DIFFERENCES.items()
}


def train_preset_names() -> list[str]:
    return sorted(PRESETS)


def _resolve_drafter(section: DrafterSection) -> tuple[Any, BaseModel]:
    """The registered training method of ``drafter.name`` and its validated options."""
    from specforge.plugins import get_host

    host = get_host()
    drafters = host.registry.of_kind(ComponentKind.DRAFTER)
    trainable = sorted(n for n, r in drafters.items() if r.metadata.training is not None)
    reg = drafters.get(section.name)
    if reg is None or reg.metadata.training is None:
        what = "an unknown drafter" if reg is None else "a drafter without a training method"
        raise TrainConfigError([f"drafter.name: {section.name!r} is {what}; trainable drafters: "
                                f"{', '.join(trainable) or '(none)'}"])
    method = reg.metadata.training
    try:
        return method, method.config.model_validate(section.options(), context={"host": host})
    except ValidationError as exc:
        raise TrainConfigError(validation_problems(exc, method.config, ["drafter"], named=True)) from None


def validate_train_config(raw: dict[str, Any], source: str = "") -> TrainConfig:
    """Validate a composed dict; one :class:`ConfigError` naming every bad key path.

    The ``drafter`` section is checked against its method's own config model (its problems are
    reported with the others), and stored with every default filled in (what a checkpoint
    records)."""
    problems: list[str] = []
    config = options = None
    try:
        config = TrainConfig.model_validate(raw)
    except ValidationError as exc:
        problems += [p for p in validation_problems(exc, TrainConfig) if not p.startswith("drafter.")]
    try:
        _, options = _resolve_drafter(DrafterSection.model_validate(TrainConfig._loss_moved(raw).get("drafter") or {}))
    except TrainConfigError as exc:
        problems += exc.problems
    except ValidationError as exc:
        problems += validation_problems(exc, DrafterSection, ["drafter"], named=True)
    if problems or config is None or options is None:
        raise TrainConfigError(problems, source)
    drafter = DrafterSection.model_validate({"name": config.drafter.name, **options.model_dump(mode="json")})
    return config.model_copy(update={"drafter": drafter})


def load_train_config(sources: list[str] | str = "quick", overrides: list[str] | None = None) -> TrainConfig:
    """Compose presets / YAML files left to right, then ``key=value`` overrides, and validate."""
    sources = [sources] if isinstance(sources, str) else list(sources)
    files, layers = [], []
    for src in sources:
        if src in PRESETS and not Path(src).is_file():
            layers.append(OmegaConf.create(copy.deepcopy(PRESETS[src])))
        elif Path(src).is_file():
            files.append(src)
            layers.append(OmegaConf.create(compose([src])))
        else:
            raise TrainConfigError([f"{src}: no such config file or training preset; presets: "
                               f"{', '.join(train_preset_names())}"])
    # A layer that names another drafter starts its section afresh (as in a pipeline): the
    # presets' DSpark keys must not reach `drafter.name=eagle3`.
    merged = OmegaConf.create({})
    for layer in layers:
        merged = merge_layer(merged, layer)
    # total_steps and epochs are alternatives: overriding one replaces the other from the sources.
    keys = {o.split("=", 1)[0].strip() for o in overrides or []}
    for given, other in (("total_steps", "epochs"), ("epochs", "total_steps")):
        if f"schedule.{given}" in keys and f"schedule.{other}" not in keys and "schedule" in merged:
            merged.schedule[other] = None
    raw = OmegaConf.to_container(merge_layer(merged, OmegaConf.create(compose([], overrides))), resolve=True)
    return validate_train_config(raw, source=", ".join(sources))  # type: ignore[arg-type]
