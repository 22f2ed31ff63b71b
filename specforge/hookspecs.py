"""The hook specifications: the one module a plug-in author needs to read.

A plug-in is any module (or object) with functions marked ``@specforge.hookimpl`` whose names
match the specs below.  It is found through the ``specforge`` entry-point group of its
distribution::

    # pyproject.toml of your package
    [project.entry-points.specforge]
    my_plugin = "my_package.plugin"

Every spec follows the *register-callback* style: the host calls your hook with a ``register``
function and you call it once per component you provide::

    from specforge import hookimpl

    @hookimpl
    def specforge_register_schedulers(register):
        register("budget", BudgetScheduler, config=BudgetConfig,
                 description="verify at most N draft tokens per round")

``register(name, factory, config=None, **metadata)``:

* ``name`` — lower-case, ``[a-z0-9][a-z0-9_-]*``; the name a pipeline YAML selects.
* ``factory`` — called as ``factory(config)`` with the validated config instance.
* ``config`` — a pydantic model with ``extra="forbid"`` describing the component's parameters
  (omit it when there are none).  Unknown keys in a pipeline YAML are rejected against it.
* ``**metadata`` — validated by the kind's metadata model (see :mod:`specforge.registry`); every
  kind accepts ``description`` and ``examples`` (parameter sets the conformance suite tries,
  each validated against ``config`` at registration; default: the config's defaults).

The host owns ordering, validation and conflicts: a duplicate name is an error that names both
packages, and a plug-in whose import or registration fails is reported and skipped.  pluggy never
fills in default argument values, so hook implementations must accept ``register`` explicitly.

One hook registers something other than a component: :func:`specforge_register_commands` adds a
sub-command to the ``specforge`` command line, with a ``register`` of its own signature.
"""

from __future__ import annotations

import pluggy

PROJECT = "specforge"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def specforge_register_drafters(register):
    """Register drafters: models that propose a block of γ tokens per round.

    A drafter's factory returns an object implementing :class:`specforge.components.Drafter`.  It
    must report, for every token it proposes, the law the token was *actually* drawn from
    (warped with :func:`specforge.sampling.warp`), or declare itself deterministic (one-hot q).

    Metadata: ``deterministic`` (bool, default ``False``) — the drafter's q is always one-hot;
    ``parallel`` (bool) — one backbone pass drafts the whole block; ``provides`` — the
    :class:`~specforge.components.DraftBlock` fields it fills among ``"probs"``, ``"logits"``,
    ``"hidden"``, ``"confidence"``; ``uses_correction_head`` (bool) — it runs the pipeline's correction head,
    handed over each round as ``DraftContext.correction_head`` (if not, only identity heads
    combine with it); ``training`` — a training method (:mod:`specforge.toolkit.training`): a
    class with a pydantic ``config`` model, which makes the drafter trainable by
    ``specforge train drafter.name=<name>`` (shown as ``trainable`` by ``specforge plugins``).
    """


@hookspec
def specforge_register_correction_heads(register):
    """Register correction heads: sequential biases on a parallel drafter's logits.

    A head's factory returns a :class:`specforge.components.CorrectionHead`.  At slot k it sees
    the block's logits U_k, the previous draft token x_{k-1} (the anchor for k = 1) and the
    backbone hidden state h_k, and returns biased logits plus its carried state.

    Metadata: ``trainable`` (bool) — the head has weights that the trainer updates;
    ``identity`` (bool) — it leaves the logits unchanged, so it fits any drafter.
    """


@hookspec
def specforge_register_confidence_estimators(register):
    """Register confidence estimators: per-position pre-token survival estimates c_k ∈ (0, 1).

    A factory returns a :class:`specforge.components.ConfidenceEstimator`.  c_k estimates
    P(x_k accepted | x_<k accepted) and may use anything known *before* x_k is drawn: x_<k, the
    draft distribution q_k and the hidden state h_k — never x_k itself.  This is what keeps every
    scheduler that reads it lossless.

    Metadata: ``pre_token`` (must be ``True`` for a scheduler to trust it), ``trainable``,
    ``needs_any`` — DraftBlock fields of which it needs at least one (pairs it with drafters
    that ``provides`` them).
    """


@hookspec
def specforge_register_calibrators(register):
    """Register calibrators: maps from raw confidences to calibrated ones.

    A factory returns a :class:`specforge.components.Calibrator` with ``fit``, ``apply``,
    ``save`` and ``load``.  ``apply`` must be order-preserving at each position, so that
    calibration changes magnitudes (what a hardware-aware scheduler needs) but never rankings.

    Metadata: ``trainable`` (bool) — the calibrator has parameters that ``fit`` estimates.
    """


@hookspec
def specforge_register_schedulers(register):
    """Register schedulers: they pick each request's verify length ℓ_r for the round.

    A factory returns a :class:`specforge.components.Scheduler`.  Whether position k is verified
    may depend on x_<k, on the confidences (which are pre-token) and on history, never on x_k,
    later drafts, target outputs or the verifier's uniforms (docs/design/verification.md#causality).

    Metadata: ``reads`` — a list among ``"confidence"``, ``"hardware_profile"`` and
    ``"history"``, so tools can tell which inputs change its decisions.
    """


@hookspec
def specforge_register_verifiers(register):
    """Register verifiers: they accept a prefix of each draft and emit one target token.

    A factory returns a :class:`specforge.components.Verifier`, vectorised over a batch whose
    requests verify different numbers of tokens.

    Metadata: ``lossless`` (bool, required) — whether the output law provably equals the
    target's; a lossy verifier is never certified by the conformance suite.
    ``greedy_only`` (bool) — valid only at temperature 0.
    """


@hookspec
def specforge_register_commands(register):
    """Register sub-commands of the ``specforge`` command line (``specforge conformance`` is one).

    ``register(name, add_arguments, run, help="", description=None)``:

    * ``name`` — lower-case, ``[a-z0-9][a-z0-9_-]*``; ``specforge NAME`` runs the command.  A
      built-in command's name cannot be taken over.
    * ``add_arguments(parser)`` — declares the command's options on its own
      :class:`argparse.ArgumentParser`; it may add sub-parsers of its own.
    * ``run(args)`` — runs the command with the parsed :class:`argparse.Namespace` and returns the
      exit status (0 for success).  Raise :class:`specforge.errors.SpecforgeError` for bad input:
      the CLI prints its message on one line and exits with status 2.
    * ``help`` — the line ``specforge --help`` shows; ``description`` — the top of
      ``specforge NAME --help`` (default: ``help``).

    Keep the module the entry point names cheap to import (import heavy dependencies inside
    ``run``): the CLI loads every plug-in to build its parser, whatever command it then runs.
    """
