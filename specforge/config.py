"""Pipeline configuration: OmegaConf composes, pydantic validates, once.

A pipeline is YAML like::

    target: {model: smollm2, dtype: auto}
    sampling: {temperature: 1.0, top_k: 0, top_p: 1.0, seed: 0, max_new_tokens: 128}
    drafter: null                      # null: plain autoregressive decoding
    correction_head: {name: none}
    confidence: {name: constant, value: 0.8}
    calibrator: {name: identity}
    scheduler: {name: fixed}
    verifier: {name: rejection}

Sources are merged left to right (files or named presets shipped in ``specforge/presets``), then
dot-list overrides (``scheduler.name=threshold scheduler.theta=0.4``).  Each component slot is
``{name: <registered name>, ...params}`` (or just the name); the named plug-in's own pydantic model
validates the params.  Every problem is collected and reported in one :class:`ConfigError` that
names the key path and the valid choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specforge.errors import ConfigError, validation_problems
from specforge.plugins import PluginHost, get_host
from specforge.registry import ComponentKind, Registration

__all__ = [
    "ComponentSpec",
    "EngineConfig",
    "PipelineConfig",
    "SamplingConfig",
    "TargetConfig",
    "compose",
    "load_pipeline",
    "preset_names",
    "validate_pipeline",
]

PRESET_DIR = Path(__file__).parent / "presets"

# Slots left out of a YAML take these components (the kinds' table).  No drafter means plain decoding.
DEFAULT_COMPONENTS: dict[ComponentKind, str | None] = {kind: kind.spec.default for kind in ComponentKind}


# The KV cache's dtype choices (specforge.runtime.torch.kv_dtype resolves them).
KVDtype = Literal["auto", "model", "float32"]
# What computes a target's passes (specforge.runtime.choice decides ``auto``); the one list of them.
Backend = Literal["auto", "torch", "llama.cpp"]
BACKENDS: tuple[str, ...] = get_args(Backend)


class TargetConfig(BaseModel):
    """The target model."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(
        "smollm2",
        description="'smollm2' (the embedded SmolLM2-135M-Instruct), a Hugging Face model "
        "directory, or a .gguf file",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="precision of the target's passes: 'auto' times float32, bfloat16, float16 (where the "
        "CPU computes it natively) and a GGUF's own 4-bit blocks on this machine's decode, verify and "
        "prefill passes once (cached) and runs each pass size in the fastest whose logits stay close to "
        "float32's; an explicit precision is used for every pass (float16 only on CPUs with native "
        "float16). Drafters, heads and training compute in the precision of 16-row passes",
    )
    compile: bool | Literal["auto"] = Field(
        False,
        description="run the target's passes through torch.compile (fused norms/rotary/residuals "
        "and decode attention; the pre-packed projections stay outside it): faster steps after "
        "a minute or two of compilation; needs a C++ compiler on CPU, else eager; auto: only where "
        "a paired measurement of decoding passes says it pays on this machine (measured once, cached)",
    )
    weights: Literal["auto", "dense", "native"] = Field(
        "auto",
        description="'native' runs a GGUF target's Q4_0/Q4_1 projections on their 4-bit blocks "
        "(torch's int4 kernel, bf16 activations; ~3x fewer bytes a decoding step) for every pass; "
        "'dense' never; 'auto' lets dtype=auto measure them as one more candidate (with an explicit "
        "dtype, auto is dense). GGUF targets only, with bfloat16 activations",
    )
    backend: Backend = Field(
        "auto",
        description="what computes the target's passes: 'torch' (the project's own runtime, any target), "
        "'llama.cpp' (a GGUF file in libllama through the llama-cpp-python binding `make install` builds; "
        "chains only, taps of layers 0..L-2), or 'auto': llama.cpp for a GGUF target on a CPU where the "
        "binding loads and it serves the drafter's taps, unless torch measured faster on this machine (once, "
        "cached); decided once when the target loads and printed with its reason. dtype, weights, compile and "
        "kv_dtype configure the torch runtime",
    )
    kv_dtype: KVDtype = Field(
        "auto",
        description="dtype of the KV cache and of the attention reading it: 'model' (the dtype "
        "above), 'float32', or 'auto' — measured once per process on a CPU: float32 when its decode "
        "attention is clearly faster than the model's dtype (4-8x on AVX512-BF16 CPUs without AMX), "
        "else the model's dtype (half the bytes); a float32 target's cache is always float32",
    )


class SamplingConfig(BaseModel):
    """Default sampling settings of requests (a request may override them)."""

    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1 disables top-p")
    seed: int = 0
    max_new_tokens: int = Field(128, ge=1)


class EngineConfig(BaseModel):
    """How the engine batches requests."""

    model_config = ConfigDict(extra="forbid")
    max_batch: int = Field(16, ge=1, description="requests decoded together (KV-cache slots)")
    max_context: int = Field(
        4096, ge=2, description="prompt + output tokens per request (capped by the model's own limit)"
    )
    prefill_chunk: int | Literal["auto", "off"] = Field(
        "auto",
        description="tokens of each waiting prompt prefilled per round while other requests decode, in the "
        "same flattened pass as their rows (chunked prefill): a long prompt then never stalls the batch; auto: "
        "the pass size past which this machine's cost per token stops falling (measured with the target's "
        "precision); off: each admitted prompt whole, in a pass of its own",
    )

    @field_validator("prefill_chunk")
    @classmethod
    def _positive_chunk(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"prefill_chunk must be auto, off or a positive number of tokens, got {value}")
        return value


@dataclass(frozen=True)
class ComponentSpec:
    """A resolved slot: the registration it names and its validated params."""

    registration: Registration
    params: BaseModel

    @property
    def name(self) -> str:
        return self.registration.name

    def create(self) -> Any:
        return self.registration.create(self.params)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.params.model_dump(mode="json")}


@dataclass(frozen=True)
class PipelineConfig:
    """A validated pipeline: target, sampling defaults and one component per slot."""

    target: TargetConfig
    sampling: SamplingConfig
    engine: EngineConfig
    components: dict[ComponentKind, ComponentSpec | None]

    def component(self, kind: ComponentKind | str) -> ComponentSpec | None:
        return self.components[ComponentKind(kind)]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "target": self.target.model_dump(mode="json"),
            "sampling": self.sampling.model_dump(mode="json"),
            "engine": self.engine.model_dump(mode="json"),
        }
        for kind in ComponentKind:
            spec = self.components[kind]
            out[kind.value] = None if spec is None else spec.to_dict()
        return out

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.create(self.to_dict()))

    def save(self, directory: str | Path) -> Path:
        """Write the resolved config beside a run's outputs; returns the file written."""
        path = Path(directory) / "pipeline.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_yaml())
        return path


SECTIONS: dict[str, type[BaseModel]] = {
    "target": TargetConfig,
    "sampling": SamplingConfig,
    "engine": EngineConfig,
}
TOP_LEVEL_KEYS = [*SECTIONS, *(k.value for k in ComponentKind)]


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _resolve_source(source: str) -> Path:
    path = Path(source)
    if path.is_file():
        return path
    preset = PRESET_DIR / f"{source}.yaml"
    if "/" not in source and preset.is_file():
        return preset
    raise ConfigError(
        [f"{source}: no such config file or preset; presets: {', '.join(preset_names())}"]
    )


def compose(sources: list[str], overrides: list[str] | None = None) -> dict[str, Any]:
    """Merge YAML sources and dot-list overrides into one plain dict (no validation)."""
    layers = []
    for source in sources:
        path = _resolve_source(source)
        try:
            layer = OmegaConf.load(path)
        except (OmegaConfBaseException, OSError, ValueError, yaml.YAMLError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError([f"{path}: cannot be read as YAML: {first}"]) from None
        if not OmegaConf.is_dict(layer):
            raise ConfigError([f"{path}: the top level must be a mapping"])
        layers.append(layer)
    bad = [o for o in overrides or [] if "=" not in o]
    if bad:
        raise ConfigError([f"override {o!r} must look like key.path=value" for o in bad])
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides or [])))
        merged = OmegaConf.create({})
        for layer in layers:
            merged = merge_layer(merged, layer)
        return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError([f"cannot merge configs: {exc}".splitlines()[0]]) from None


def merge_layer(base: Any, layer: Any) -> Any:
    """``layer`` merged over ``base`` (OmegaConf), except that a component section whose ``name``
    the layer changes starts afresh from the layer's keys: ``scheduler.name=fixed`` over a
    ``hw-prefix`` section must not leave hw-prefix's ``profile`` behind."""
    base, layer = OmegaConf.create(base), OmegaConf.create(layer)
    for kind in ComponentKind:
        slot = kind.value
        new = layer.get(slot) if OmegaConf.is_dict(layer) else None
        old = base.get(slot) if OmegaConf.is_dict(base) else None
        if OmegaConf.is_dict(new) and "name" in new and OmegaConf.is_dict(old) and old.get("name") != new.get("name"):
            base[slot] = None
    return OmegaConf.merge(base, layer)


def _resolve_slot(
    kind: ComponentKind, raw: Any, host: PluginHost, problems: list[str]
) -> ComponentSpec | None:
    slot = kind.value
    if raw is None:
        if kind is ComponentKind.DRAFTER:
            return None
        problems.append(f"{slot}: a {kind.label} is required; registered: {', '.join(host.names(kind))}")
        return None
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict):
        problems.append(f"{slot}: expected a mapping {{name: ..., ...params}} or a name, got {raw!r}")
        return None
    params = dict(raw)
    name = params.pop("name", None)
    names = host.names(kind)
    if name is None:
        problems.append(f"{slot}.name: required key is missing; registered {kind.label}s: {', '.join(names) or '(none)'}")
        return None
    if name not in names:
        problems.append(
            f"{slot}.name: unknown {kind.label} {name!r}; registered {kind.label}s: "
            f"{', '.join(names) or '(none)'}"
        )
        return None
    reg = host.get(kind, name)
    try:
        # The host as validation context: a composed component resolves its members against it.
        return ComponentSpec(reg, reg.config.model_validate(params, context={"host": host}))
    except ValidationError as exc:
        problems.extend(validation_problems(exc, reg.config, [slot], named=True, owner=f" for {kind.label} {name!r}"))
        return None


def validate_pipeline(
    raw: dict[str, Any], host: PluginHost | None = None, source: str = ""
) -> PipelineConfig:
    """Validate a composed dict against the registry; raise one :class:`ConfigError`."""
    host = host or get_host()
    problems: list[str] = []
    for key in raw:
        if key not in TOP_LEVEL_KEYS:
            problems.append(f"{key}: unknown key; valid keys: {', '.join(TOP_LEVEL_KEYS)}")
    sections: dict[str, BaseModel] = {}
    for key, model in SECTIONS.items():
        value = raw.get(key) or {}
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping, got {value!r}")
            continue
        try:
            sections[key] = model.model_validate(value)
        except ValidationError as exc:
            problems.extend(validation_problems(exc, model, [key]))
    components: dict[ComponentKind, ComponentSpec | None] = {}
    for kind in ComponentKind:
        value = raw.get(kind.value, DEFAULT_COMPONENTS[kind])
        components[kind] = _resolve_slot(kind, value, host, problems)

    verifier = components.get(ComponentKind.VERIFIER)
    sampling = sections.get("sampling")
    if verifier is not None and sampling is not None:
        if verifier.registration.metadata.greedy_only and sampling.temperature > 0:
            problems.append(
                f"verifier.name: {verifier.name!r} is valid only at temperature 0 but "
                f"sampling.temperature is {sampling.temperature}; use sampling.temperature=0 "
                "or a sampling verifier (rejection, match)"
            )
    if problems:
        raise ConfigError(problems, source)
    return PipelineConfig(
        sections["target"], sections["sampling"], sections["engine"], components  # type: ignore[arg-type]
    )


def load_pipeline(
    sources: list[str] | str = "default",
    overrides: list[str] | None = None,
    host: PluginHost | None = None,
    sections: dict[str, Any] | None = None,
) -> PipelineConfig:
    """Compose ``sources`` (files or preset names) with ``overrides`` and validate.

    ``sections`` (e.g. what a training method says serves its checkpoint) *replace* whole
    sections of the sources — a preset's ``confidence: {name: constant, value: 0.8}`` must not
    leave ``value`` behind in a ``dspark-head`` section — before the overrides apply."""
    sources = [sources] if isinstance(sources, str) else list(sources)
    raw = compose(sources)
    if sections:
        raw.update(sections)
    if overrides:
        try:
            raw = OmegaConf.to_container(merge_layer(raw, compose([], overrides)), resolve=True)
        except OmegaConfBaseException as exc:
            raise ConfigError([f"cannot merge configs: {exc}".splitlines()[0]]) from None
    return validate_pipeline(raw, host, source=", ".join(sources))
