"""The exactness property over whole training configurations drawn by Hypothesis.

Each example is a training run (``poros_fx/exactness/training_configs.py``): family at a tiny shape with
widths that are not multiples of 8, base, adapter, data, surface, accumulation, toggles, resume, every
option and the numeric modes. It is trained streamed, with ``stream=False`` and (eager codegen, HF's
loss) as the plain eager loop, on fresh models from the same seeds (``exactness/config_runs.py``); the runs
must be ``torch.equal`` on every micro-batch loss, gradient norm, adapter weight and AdamW state, or
the streamed run must raise a ``PorosError`` before its first optimizer step. A fixed set of examples
(a seed per shard, no example database) runs in CI; ``poros-fx exactness`` draws more and shrinks a
failure.
"""

from __future__ import annotations

import functools

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings

from poros_fx.exactness.config_runs import InvalidConfig, check, known_eager_difference, train_once
from poros_fx.exactness.parity import compare
from poros_fx.exactness.training_configs import Data, Shape, TrainingConfig, configs

SHARDS = 4  # pytest-xdist spreads the shards over its workers
EXAMPLES_PER_SHARD = 3


def _shard_settings(shard: int):
    return lambda test: seed(shard)(settings(
        max_examples=EXAMPLES_PER_SHARD, database=None, deadline=None, print_blob=False,
        suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])(given(configs("cpu"))(test)))


@functools.cache
def _drawn(shard: int) -> frozenset[str]:
    """The configs a shard draws, generated only (cheap), never run."""
    drawn = set()

    @_shard_settings(shard)
    def collect(config) -> None:
        drawn.add(repr(config))

    collect()
    return frozenset(drawn)


@pytest.mark.parametrize("shard", range(SHARDS))
def test_drawn_training_runs_are_exact_or_refused(shard: int) -> None:
    seen, skipped = [], []

    @_shard_settings(shard)
    def property_holds(config) -> None:
        # Hypothesis draws its simplest config first under every seed: a lower shard runs it already
        if any(repr(config) in _drawn(lower) for lower in range(shard)):
            skipped.append(config)
            return
        try:
            outcome = check(config, "cpu")
        except InvalidConfig:
            hypothesis.reject()  # transformers or PEFT refuse this model by themselves
        seen.append(outcome.status)
        assert outcome.holds, f"{outcome.status}: {outcome.detail}\n{config.describe()}\n{config!r}"

    property_holds()
    assert len(seen) + len(skipped) == EXAMPLES_PER_SHARD, seen
    assert "equal" in seen or skipped, seen  # not a set of refusals only (a skipped one is equal in a lower shard)


# Found by the generator (seed 5 of `poros-fx exactness`) and not fixed yet: PorosTrainer with the Trainer's
# bf16 autocast and LoRA dropout on Qwen3.5's in_proj_b equals stream=False but not the plain Trainer (lora_A's
# gradient, ~1e-9); the same loop through torch.compile or @poros_fx.step is equal.
TRAINER_AUTOCAST_DELTANET = (
    "TrainingConfig(shape=Shape(family='qwen3_5_text', layers=2, heads=3, kv_heads=3, head_dim=10, intermediate=79, "
    "vocab=137, config=(('attn', 'eager'), ('layer_types', ('linear_attention', 'full_attention')))), base='bf16', "
    "rank=8, alpha=16, dropout=0.1, targets=('in_proj_b',), expert_lora=False, dora=False, attach_after_prepare=False, "
    "data=Data(batch=3, lengths=(19,), padding='none', ignored=False, num_items=False, seed=1), surface='trainer', "
    "accumulate=1, steps=1, block_major=False, clip=None, toggles=(), edit_adapter=False, resume_at=None, "
    "options=(('block_size', 1), ('codegen', 'eager'), ('prefetch', 1)), deterministic=False, tf32=False, "
    "autocast=True, fast_sdpa=False, seed=3332)")


@pytest.mark.xfail(strict=True, reason="open: PorosTrainer + bf16 autocast + LoRA dropout on a Gated DeltaNet "
                                       "projection differs from the plain Trainer (docs/exactness.md)")
def test_trainer_autocast_dropout_on_gated_deltanet_equals_the_plain_trainer() -> None:
    config = eval(TRAINER_AUTOCAST_DELTANET, {"TrainingConfig": TrainingConfig, "Shape": Shape, "Data": Data})
    assert known_eager_difference(config)  # the property compares it with stream=False only, until this passes
    streamed, _ = train_once(config, "streamed", torch.device("cpu"))
    eager, _ = train_once(config, "eager", torch.device("cpu"))
    diffs = compare(streamed, eager)
    assert all(v == 0.0 for v in diffs.values()), diffs



# Found by the generator (CI's shard 3): Inductor's lowering of the Gated DeltaNet conv1d's backward fixed the
# sequence length the region was first compiled at, and the next micro-batch's length ran that code.
DELTANET_INDUCTOR_LENGTHS = (
    "TrainingConfig(shape=Shape(family='qwen3_5_text', layers=2, heads=3, kv_heads=1, head_dim=10, intermediate=69, "
    "vocab=71, config=(('layer_types', ('full_attention', 'linear_attention')),)), base='nf4', rank=3, alpha=16, "
    "dropout=0.0, targets=('in_proj_qkv', 'q_proj'), expert_lora=False, dora=False, attach_after_prepare=False, "
    "data=Data(batch=1, lengths=(4, 12), padding='none', ignored=False, num_items=True, seed=66), surface='step', "
    "accumulate=2, steps=1, block_major=False, clip=None, toggles=(), edit_adapter=False, resume_at=None, "
    "options=(('codegen', 'inductor'),), deterministic=True, tf32=False, autocast=False, fast_sdpa=False, seed=782)")


def test_gated_deltanet_under_inductor_takes_every_length_from_one_compile(caplog) -> None:
    config = eval(DELTANET_INDUCTOR_LENGTHS, {"TrainingConfig": TrainingConfig, "Shape": Shape, "Data": Data})
    with caplog.at_level("INFO", logger="poros_fx"):
        streamed, _ = train_once(config, "streamed", torch.device("cpu"))  # the second length crashed here
    assert len(streamed.losses) == 2
    traced = [r.getMessage() for r in caplog.records if "traced region" in r.getMessage()]
    assert len(traced) == 2, traced  # one region per layer structure, for both lengths
    assert not [r for r in caplog.records if "compiled region" in r.getMessage() and r.levelname == "WARNING"]
